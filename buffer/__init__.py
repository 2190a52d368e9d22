"""The replay buffer: group records, their codec, Redis Streams storage, the embedded server.

Knows Redis and nothing about models.
"""
