"""The engines behind each model: the pool that reaches them, its transport, and the relay.

``pool`` picks a replica and retries; ``aiohttp_transport`` carries httpx over aiohttp;
``stream_relay`` hands the engine's answer to the client and measures its usage.
"""
