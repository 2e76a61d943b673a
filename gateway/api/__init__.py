"""The HTTP surface: OpenAI routes, admin and tenant APIs, their bodies, errors and OpenAPI.

Handlers read a request (``request_body``, ``admin_inputs``), reach the gateway's parts
through ``handler_context``, and raise ``errors.ApiError``; ``errors`` alone writes the body.
"""
