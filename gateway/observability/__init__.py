"""What the gateway reports about itself: Prometheus metrics and OpenTelemetry spans.

``loop_histogram`` is a cheaper histogram for values observed on the event loop.
"""
