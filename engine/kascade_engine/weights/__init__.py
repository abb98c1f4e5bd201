"""Weights: the model as blocks (a BlockSet of digested, aligned tensors), read from checkpoints and tensor
files, verified per block, kept in host memory (host copy, host-cache file) and received into a reserved
arena. What moves the blocks over the network is net/; what loads them into an instance is loader.py.
"""
