"""staleflow.actors"""
