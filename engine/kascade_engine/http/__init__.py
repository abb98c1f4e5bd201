"""The HTTP edge: the FastAPI server (OpenAI API, control API, metrics), request parsing and guards,
the streaming responder and incremental detokenization. It parses and calls the instance; no state here.
"""
