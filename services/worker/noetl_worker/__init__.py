"""The worker role: claims commands, runs their tools, persists results, reports them.

    main.py        entry point (``noetl-worker`` / ``python -m noetl_worker``)
    service.py     WorkerService: NATS pull slots, ClaimCommand / RenewLease, publishing
    runner.py      execute_command: one claimed command -> CallResult (persist-before-emit)
    cursor.py      run_cursor_slot: one slot of a cursor loop (claim -> report -> commit -> run)
    cursor_drivers/  the cursor driver registry (register_driver / lookup); postgres
    scope.py       the render scope of a command (resolves only referenced step results)
    pipeline.py    task pipelines and task policies (pure logic)
    tools/         python (warm sandbox pool), http, postgres, noop, workbook, playbook
    sandbox.py     the child interpreter of the python pool
    metrics.py     Prometheus metrics

Nothing is re-exported here on purpose: the python sandbox child imports this package
and must start without loading gRPC, NATS or psycopg.
"""

import noetl_common  # noqa: F401  (first: gRPC fork support off before gRPC loads)
