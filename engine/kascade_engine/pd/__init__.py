"""Prefill/decode disaggregation: the prefill server and the remote prefill that ships KV over the data
port (kv_wire), a converted decoder's hand-back and prefill probe, and the PD metrics.
"""
