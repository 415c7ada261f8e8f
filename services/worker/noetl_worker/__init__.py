"""The worker role: claims commands, runs their tools, persists results, reports them.

    main.py        entry point (``noetl-worker`` / ``python -m noetl_worker``)
    service.py     WorkerService: NATS pull slots, ClaimCommand / RenewLease, publishing
    runner.py      execute_command: one claimed command -> CallResult (persist-before-emit)
    scope.py       the render scope of a command (resolves only referenced step results)
    pipeline.py    task pipelines and task policies (pure logic)
    tools/         python (warm sandbox pool), http, postgres, noop, workbook
    sandbox.py     the child interpreter of the python pool
    metrics.py     Prometheus metrics

Nothing is re-exported here on purpose: the python sandbox child imports this package
and must start without loading gRPC, NATS or psycopg.
"""
