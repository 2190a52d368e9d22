"""staleflow.buffer"""
