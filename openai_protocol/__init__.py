"""The OpenAI-compatible wire format that both Tollway processes speak.

The engine's HTTP server (`backend_engine.server`) and the gateway (`gateway.api`,
`gateway.upstream`) both import this package, and it imports neither of them, nor torch:
a gateway installed without the engine has all of it.

- `request_models`: the completion request bodies (pydantic);
- `field_rules`: what each request field may hold, checked by both before anything else;
  `schema_rules` (output constraints, every JSON Schema's bounds) and `tool_rules` (tools,
  tool_choice) are its parts, `field_errors` the refusals in OpenAI's words;
- `json_body`: a request body as a JSON object, nested at most 64 deep;
- `errors`: the error vocabulary (body shape, types, codes, status -> type);
- `sse`: server-sent-events framing and the streaming response;
- `disconnect`: work that stops when the HTTP client leaves.

Nothing is imported here, so importing one module loads only what it needs.
"""
