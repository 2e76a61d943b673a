"""Who is calling: bearer API keys, the admin key, and the cache that keeps keys in memory.

``epochs`` lets every replica see a revoked key or changed quota on the next request.
"""
