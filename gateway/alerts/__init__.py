"""Budget alerts: thresholds crossed after a settle become events in the database's outbox
(`budget_watch`), which a background task posts to the configured webhook, signed
(`webhook_delivery`, `webhook_signature`). The rule for a crossing is
`policies.budget_alerts`; the settings are `gateway.alert_settings`."""
