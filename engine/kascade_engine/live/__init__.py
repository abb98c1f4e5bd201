"""Live scaling: a loading engine runs the resident prefix of layers and a full peer the rest (cooperation,
pair client/session, the per-request split), requests redirected or forwarded between the pair, decode-state
migration once the loader holds every layer, and the ZigZag live policy. It plugs into the batch through
the step hooks (`StepHooks`, batch/engine.py); batch/ never imports it.
"""
