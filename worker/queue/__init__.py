"""The worker's queue side: the Redis consumer that arq hosts (`arq worker.WorkerSettings`).

`consumer` ties the engine thread to Redis through asyncio tasks: `intake` (XREADGROUP as
many jobs as the engine has room for) and its reclaimer, `publisher` (a step's outputs in
one Lua call), `heartbeat` (the worker hash, cancels, deadlines, trims), the listeners;
`engine_thread` steps the engine in its own thread; `scripts` holds every Lua script and
its typed caller; `jobs` the held jobs' state; `config` the worker's frozen configuration,
read from GENQ_* variables at the entry point; `outage` how a worker waits out Redis.
"""
