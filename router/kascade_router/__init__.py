"""Kascade's front door: an OpenAI-compatible proxy that routes by `model` to serving engine pods."""
