"""staleflow.cluster"""
