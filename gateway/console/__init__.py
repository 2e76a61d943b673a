"""The admins' console at ``/ui``: server-rendered pages over the gateway's own storage,
metrics and replica state (`console_app.build_console`)."""
