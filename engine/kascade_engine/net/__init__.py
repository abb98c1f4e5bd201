"""The data plane: transports (tcp, tls, ucx) with peer authentication and pacing, and the weight relay
that streams a load plan's blocks down a chain (forwarding, recovery from a lost upstream, the transfer spec).
Above weights/ (it moves blocks), below the serving wings that speak it (live/, pd/).
"""
