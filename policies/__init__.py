"""Pure policy functions: (request, tenant state, now) -> decision. No I/O."""
