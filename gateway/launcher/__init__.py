"""The ``tollway`` command line and ``tollway serve``: config, first start, engine processes.

``cli`` is the entry point; ``serve`` brings up the whole stack on one machine, with
``serve_config`` (what runs), ``data_dir_setup`` (what is created once) and
``engine_processes`` (engines as child processes).
"""
