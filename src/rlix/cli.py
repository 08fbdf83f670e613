"""`rlix` command line: run, sim, check, eval, status, timeline, serve, router, export; and for a shared
cluster up, submit, jobs, cancel, logs, down.

Every error is printed as one line and exits 2 (Ctrl-C: 130); `--debug` shows the traceback
instead.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from typing import NoReturn

from rlix import env
from rlix.errors import ConfigError, RlixError, SchedulerError
from rlix.inference.server.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, StoreLimits
from rlix.version import package_version


def _cmd_sim(args: argparse.Namespace) -> int:
    from rlix.sim import cli_sim  # deferred: see _cmd_run

    return cli_sim(args.scenario, args.json, out=args.out)


def _cmd_timeline(args: argparse.Namespace) -> int:
    from rlix.run_summary import load_summary  # deferred: see _cmd_run
    from rlix.timeline import CHART_FILE, TRACE_FILE, account_lines, write_timeline  # deferred: see _cmd_run

    account = write_timeline(args.run_dir, load_summary(args.run_dir))
    print("\n".join(account_lines(account)))
    print(f"wrote {os.path.join(args.run_dir, TRACE_FILE)} (open in ui.perfetto.dev) and "
          f"{os.path.join(args.run_dir, CHART_FILE)}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    # deferred: each command imports only what it runs (`rlix check` needs neither torch nor Ray)
    from rlix.config import load_config
    from rlix.config.preflight import refuse_reused_run_dir  # deferred: see above

    cfg = load_config(args.config, args.set)  # a bad file or --set fails here, before Ray
    if not (args.resume or args.overwrite):  # a run_dir holding a previous run is refused, before Ray
        refuse_reused_run_dir(cfg, args.config)
    from rlix.run import run  # deferred: see above
    from rlix.run_summary import RunSummary  # deferred: see above

    summary = RunSummary.model_validate(run(args.config, resume=args.resume, mode=args.mode, address=args.address,
                                            overrides=args.set))
    import ray  # deferred: see above

    if ray.is_initialized():  # the cluster's workers end here (pinned buffers freed): said, as it takes seconds
        t0 = time.perf_counter()
        ray.shutdown()
        print(f"Ray stopped in {time.perf_counter() - t0:.1f}s", flush=True)
    # a run where some pipeline failed (the others finished) or served unsynced weights
    failed = [n for n, s in summary.pipelines.items() if s.version_mismatches or s.failed]
    return 1 if failed else 0


def _cmd_check(args: argparse.Namespace) -> int:
    from rlix.config import load_config  # deferred: see _cmd_run
    from rlix.config.overrides import read_back  # deferred: see _cmd_run
    from rlix.config.preflight import preflight  # deferred: see _cmd_run

    cfg = load_config(args.config, args.set)
    preflight(cfg, args.config)
    cluster = "auto (from Ray)" if cfg.cluster.is_auto else (
        f"{cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} GPUs")
    if cfg.cluster.gpu_slices > 1:
        cluster += f", each scheduled as {cfg.cluster.gpu_slices} slices"
    print(f"{args.config}: ok; cluster {cluster}; {len(cfg.pipelines)} pipeline(s)")
    for p in cfg.pipelines:
        print(f"  {p.name}: priority {p.priority}, weight {p.weight}, train {p.train_gpus} GPU(s), "
              f"shards {p.min_shards}..{p.max_shards} x tp {p.tp}, "
              f"partial overlap {'on' if p.partial_overlap else 'off'}, max staleness {p.max_staleness}")
    for item in args.set:
        print(f"  --set {item.partition('=')[0].strip()}: {json.dumps(read_back(cfg, item), default=str)}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from rlix.eval_command import Overrides, run_eval  # deferred: see _cmd_run (torch, the engine)

    overrides = Overrides(samples=args.samples, k=args.k, temperature=args.temperature, threshold=args.threshold,
                          max_new_tokens=args.max_new_tokens)
    run_eval(args.target, task=args.task, config=args.config, checkpoint=args.checkpoint, pipeline=args.pipeline,
             overrides=overrides, device=args.device, max_num_seqs=args.max_num_seqs)
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ev = sub.add_parser("eval", help="score a config's models or a checkpoint on the held-out set (pass@1, "
                                     "pass@k), on an embedded engine in this process")
    ev.add_argument("target", help="a run config YAML (each pipeline's model on its eval.task) or a model "
                                   "folder (e.g. RUN_DIR/NAME/checkpoint/.../model)")
    ev.add_argument("--task", default=None, metavar="TASK.yaml",
                    help="the held-out set as a YAML task config (a pipeline's task: mapping)")
    ev.add_argument("--config", default=None, metavar="CONFIG.yaml",
                    help="with a model folder: take the held-out task and eval settings of this config's pipeline")
    ev.add_argument("--checkpoint", default=None, metavar="latest",
                    help="with a config: evaluate each pipeline's newest checkpoint in run_dir instead of its model")
    ev.add_argument("--pipeline", default=None, metavar="NAME", help="only this pipeline of the config")
    ev.add_argument("--samples", type=int, default=None, help="held-out prompts (default: eval.samples)")
    ev.add_argument("-k", type=int, default=None, help="sampled responses per prompt for pass@k (default: eval.k)")
    ev.add_argument("--temperature", type=float, default=None, help="of the sampled responses (default: eval's)")
    ev.add_argument("--threshold", type=float, default=None, help="a reward this high passes (default: eval's)")
    ev.add_argument("--max-new-tokens", type=int, default=None, help="per response (default: rollout's)")
    ev.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ev.add_argument("--max-num-seqs", type=int, default=32, help="sequences the engine decodes at once")
    ev.set_defaults(func=_cmd_eval)


def _cmd_status(args: argparse.Namespace) -> int:
    import ray  # deferred: see _cmd_run

    from rlix.cluster.commands import reachable, read_state  # deferred: see _cmd_run

    state = read_state()
    address = args.address or env.ray_address() or (state["address"] if state else "auto")
    if args.interval <= 0:
        raise ConfigError(f"--interval must be > 0 seconds, got {args.interval}")
    reachable(address)
    try:
        ray.init(address=address, namespace="rlix", logging_level="ERROR", log_to_driver=False)
    except ConnectionError:
        raise SchedulerError("no Ray cluster is running here (start one with `rlix up`, or give "
                             "--address host:port / RAY_ADDRESS)") from None
    try:
        return _show_status(args, address)
    finally:
        ray.shutdown()


def _fetch_status(address: str, whole: bool = False):  # type: ignore[no-untyped-def]
    """The scheduler's view (whole: its snapshot) and, on a shared cluster, its jobs (None on a
    cluster of `rlix run`)."""
    import ray  # deferred: see _cmd_run

    from rlix.scheduler.service import get_scheduler  # deferred: see _cmd_run

    scheduler = get_scheduler()
    snap = ray.get((scheduler.snapshot if whole else scheduler.view).remote(), timeout=30)
    try:
        from rlix.cluster.registry import get_registry  # deferred: see _cmd_run

        rows = ray.get(get_registry().jobs.remote(), timeout=30)
    except ConfigError:  # a cluster of `rlix run`: no job registry
        rows = None
    return snap, rows


def _show_status(args: argparse.Namespace, address: str) -> int:
    """Once (--once, or not a terminal), or a table refreshed every --interval seconds until
    Ctrl-C (--watch, the default on a terminal; off a terminal each refresh is printed in turn)."""
    from rich.live import Live  # deferred: see _cmd_run

    from rlix.cluster.commands import jobs_table  # deferred: see _cmd_run
    from rlix.cluster.status_view import render, status_console  # deferred: see _cmd_run

    def frame():  # type: ignore[no-untyped-def]
        view, rows = _fetch_status(address)
        return view, rows, render(view, address, jobs_table(rows) if rows else None)

    if args.json:
        snap, rows = _fetch_status(address, whole=True)
        print(json.dumps({"scheduler": snap, "jobs": rows}, indent=2, default=str))
        return 0
    console = status_console()
    watch = args.watch or (not args.once and console.is_terminal)
    if not watch:
        console.print(frame()[2])
        return 0
    frames = 0
    try:
        if console.is_terminal:
            with Live(frame()[2], console=console, refresh_per_second=4) as live:
                frames = 1
                while args.count is None or frames < args.count:
                    time.sleep(args.interval)
                    live.update(frame()[2])
                    frames += 1
        else:
            while args.count is None or frames < args.count:
                if frames:
                    time.sleep(args.interval)
                table = frame()[2]  # fetched first: a Ctrl-C while fetching leaves no header without its table
                console.print(f"--- rlix status at {time.strftime('%H:%M:%S')}", table)
                frames += 1
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from rlix.cluster.commands import up  # deferred: see _cmd_run

    up(num_gpus=args.num_gpus, num_cpus=args.num_cpus, gpu_slices=args.gpu_slices, quotas=args.quota,
       default_quota=args.default_quota, address=args.address, dwell_s=args.dwell_s, aging_s=args.aging_s,
       rotate_s=args.rotate_s, report_stale_s=args.report_stale_s,
       metrics_port=args.metrics_port, dashboard_port=args.dashboard_port)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from rlix.cluster.commands import down  # deferred: see _cmd_run

    down()
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    from rlix.cluster.commands import submit  # deferred: see _cmd_run

    submit(args.config, name=args.name, user=args.user, resume=args.resume, overwrite=args.overwrite,
           address=args.address, overrides=args.set)
    return 0


def _cmd_jobs(args: argparse.Namespace) -> int:
    from rlix.cluster.commands import jobs, jobs_table  # deferred: see _cmd_run

    rows = jobs(args.address)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        for line in jobs_table(rows):
            print(line)
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    from rlix.cluster.commands import cancel  # deferred: see _cmd_run

    row = cancel(args.name, wait_s=args.wait, address=args.address)
    return 0 if row["state"] in ("cancelled", "done", "failed") else 1


def _cmd_logs(args: argparse.Namespace) -> int:
    from rlix.cluster.commands import logs  # deferred: see _cmd_run

    logs(args.name, follow=args.follow, address=args.address)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from rlix.export import export_checkpoint  # deferred: see _cmd_run (torch, transformers)

    src = export_checkpoint(args.checkpoint, args.dest, model=args.model)
    print(f"exported {src} to {args.dest} (a Hugging Face folder: transformers, rlix serve and vLLM load it)")
    return 0


def _token_flag(prog: str, flag: str, value: str | None, var: str) -> str | None:
    """A token given on the command line, with a warning: every user of this machine can read
    a process's command line (ps, /proc/PID/cmdline), and with the token control its servers.
    rlix itself never passes one so; the environment variable is the way."""
    if value:
        print(f"{prog}: warning: {flag} is visible to every user of this machine (ps, /proc/PID/cmdline); "
              f"set {var} instead", file=sys.stderr)
    return value


def _cmd_serve(args: argparse.Namespace) -> int:
    from rlix.inference.server.app import serve  # deferred: see _cmd_run (torch, the engine)

    api_key = _token_flag("rlix serve", "--api-key", args.api_key, env.API_KEY_VAR) or env.api_key()
    if not api_key:  # as vLLM without --api-key; the control plane can stop or replace the model
        print(f"rlix serve: no --api-key or {env.API_KEY_VAR}: the OpenAI API is open to whoever reaches "
              f"{args.host}:{args.port}; the control plane (pause, sleep, weights) is refused "
              f"(set {env.API_KEY_VAR} to use it)", file=sys.stderr)
    print(f"rlix serve: {args.model} on http://{args.host}:{args.port} ({args.device})", file=sys.stderr)
    serve(args.model, host=args.host, port=args.port, api_key=api_key, device=args.device,
          max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
          served_model_name=args.served_model_name, dtype=args.dtype,
          max_body=int(args.max_body_mib * 2**20), record_generations=args.record_generations,
          memory_share=env.gpu_memory_share(), threads=args.threads, capture_graphs=args.capture_graphs,
          responses_store=_store_limits(args), tensor_parallel_size=args.tensor_parallel_size)
    return 0


def _store_limits(args: argparse.Namespace) -> StoreLimits:
    """The /v1/responses store's bounds from --responses-store-max and --responses-store-mib."""
    if args.responses_store_max < 0 or args.responses_store_mib < 0:
        raise ConfigError("--responses-store-max and --responses-store-mib must be >= 0 (0 stores nothing)")
    return StoreLimits(max_responses=args.responses_store_max, max_bytes=int(args.responses_store_mib * 2**20))


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (the usage itself is one `--help` away), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _cmd_router(args: argparse.Namespace) -> int:
    from rlix.inference.router.app import parse_shards, serve_router  # deferred: see _cmd_run

    if not args.shard:
        raise ConfigError("rlix router: give at least one --shard URL")
    shards = parse_shards(args.shard)  # a bad URL fails here, before anything listens
    api_key = _token_flag("rlix router", "--api-key", args.api_key, env.API_KEY_VAR) or env.api_key()
    shard_api_key = (_token_flag("rlix router", "--shard-api-key", args.shard_api_key, env.SHARD_API_KEY_VAR)
                     or env.shard_api_key())
    if not api_key:
        api_key = secrets.token_urlsafe(24)
        print(f"rlix router: no --api-key or RLIX_API_KEY; admin token for this run: {api_key}",
              file=sys.stderr)
    print(f"rlix router: http://{args.host}:{args.port} -> " +
          ", ".join(f"shard {r} {u}" for r, u in sorted(shards.items())), file=sys.stderr)
    serve_router(args.shard, api_key=api_key, shard_api_key=shard_api_key, host=args.host,
                 port=args.port, hold_timeout_s=args.hold_timeout, max_body=int(args.max_body_mib * 2**20),
                 responses_store=_store_limits(args))
    return 0


def _set_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="change one config field before it is checked, e.g. pipelines.NAME.steps=50 or "
                             "pipelines[0].rollout.temperature=0.7 (the value read as YAML); repeatable")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="rlix", description="Time-share GPUs across RL pipelines.")
    parser.add_argument("--version", action="version", version=f"rlix {package_version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the RL pipelines of a config (time-sharing GPUs by default)")
    run.add_argument("config", help="run config YAML (see examples/two_pipelines.yaml)")
    again = run.add_mutually_exclusive_group()  # without either, a run_dir holding a previous run is refused
    again.add_argument("--resume", action="store_true", help="continue from the checkpoints in run_dir")
    again.add_argument("--overwrite", action="store_true",
                       help="start afresh in a run_dir that holds a previous run (its metrics and summary are "
                            "replaced; its checkpoints when the new run saves its own)")
    run.add_argument("--mode", choices=["rlix", "standalone"], default=None,
                     help="override control_plane (default: config, then RLIX_CONTROL_PLANE)")
    run.add_argument("--address", default=None,
                     help="attach to this Ray cluster (host:port or ray://host:port; default RAY_ADDRESS); "
                          "without one a local cluster is started")
    _set_flag(run)
    run.set_defaults(func=_cmd_run)

    sim = sub.add_parser("sim", help="simulate a cluster scenario under three scheduling policies")
    sim.add_argument("scenario", help="scenario YAML (see examples/sim/)")
    sim.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    sim.add_argument("--out", default=None, metavar="DIR",
                     help="write each policy's timeline (DIR/POLICY/: summary.json, timeline.json, timeline.png)")
    sim.set_defaults(func=_cmd_sim)

    timeline = sub.add_parser("timeline", help="redraw a run's timeline.json (Chrome/Perfetto trace) "
                                               "and timeline.png from its summary.json")
    timeline.add_argument("run_dir", help="the run's run_dir (where summary.json is)")
    timeline.set_defaults(func=_cmd_timeline)

    check = sub.add_parser("check", help="validate a run config without starting anything")
    check.add_argument("config", help="run config YAML")
    _set_flag(check)
    check.set_defaults(func=_cmd_check)
    _add_eval(sub)

    status = sub.add_parser("status", help="who holds which GPU, and the jobs of a shared cluster")
    status.add_argument("--address", default=None,
                        help="Ray address (default: RAY_ADDRESS, else the `rlix up` cluster, else auto)")
    status.add_argument("--json", action="store_true", help="the scheduler's whole snapshot and the jobs, as JSON")
    mode = status.add_mutually_exclusive_group()
    mode.add_argument("--watch", action="store_true",
                      help="refresh the table until Ctrl-C (the default on a terminal)")
    mode.add_argument("--once", action="store_true", help="print the table once (the default off a terminal)")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    status.add_argument("--count", type=int, default=None, help="stop after this many refreshes")
    status.set_defaults(func=_cmd_status)

    up = sub.add_parser("up", help="start a shared cluster: Ray, the scheduler and the job registry, left running")
    up.add_argument("--num-gpus", type=int, default=None, help="GPUs of a local Ray cluster (fake ones on CPU)")
    up.add_argument("--num-cpus", type=int, default=16, help="CPUs Ray may schedule on (default: 16)")
    up.add_argument("--address", default=None, help="use this Ray cluster instead of starting one")
    up.add_argument("--gpu-slices", type=int, default=1, help="schedule each GPU as this many (see cluster.gpu_slices)")
    up.add_argument("--quota", action="append", default=[], metavar="USER=GPUS",
                    help="the most GPUs a user's jobs may hold at once; repeat per user")
    up.add_argument("--default-quota", type=int, default=None, help="the cap for users not named (default: none)")
    up.add_argument("--dwell-s", type=float, default=30.0, help="scheduler: a woken shard is kept this long")
    up.add_argument("--aging-s", type=float, default=60.0, help="scheduler: a request waiting this long goes first")
    up.add_argument("--rotate-s", type=float, default=120.0,
                    help="scheduler: with more pipelines than GPUs, a shard changes hands after this long")
    up.add_argument("--report-stale-s", type=float, default=None,
                    help="scheduler: a progress report older than this counts as none (default: never)")
    up.add_argument("--metrics-port", type=int, default=None,
                    help="serve the scheduler's Prometheus metrics on 127.0.0.1 here (0: a free port)")
    up.add_argument("--dashboard-port", type=int, default=None,
                    help="serve the live dashboard on 127.0.0.1 here (0: a free port; the URL is printed)")
    up.set_defaults(func=_cmd_up)

    down = sub.add_parser("down", help="stop the shared cluster (its jobs are cancelled: checkpoints saved)")
    down.set_defaults(func=_cmd_down)

    submit = sub.add_parser("submit", help="add a config's pipelines to the shared cluster as one job")
    submit.add_argument("config", help="run config YAML (its cluster section is ignored: the cluster is shared)")
    submit.add_argument("--name", default=None, help="job name (default: the config file's name)")
    submit.add_argument("--user", default=None,
                        help="whose quota it counts against (default: RLIX_USER or USER); honoured for the "
                             "cluster's owner only: any other account's job counts against that account")
    again = submit.add_mutually_exclusive_group()  # without either, a run_dir holding a previous run is refused
    again.add_argument("--resume", action="store_true", help="continue from the checkpoints in run_dir")
    again.add_argument("--overwrite", action="store_true",
                       help="start afresh in a run_dir that holds a previous run (as rlix run --overwrite)")
    submit.add_argument("--address", default=None, help="Ray address (default: the `rlix up` cluster)")
    _set_flag(submit)
    submit.set_defaults(func=_cmd_submit)

    jobs = sub.add_parser("jobs", help="the jobs of the shared cluster, the queue and why each waits")
    jobs.add_argument("--json", action="store_true")
    jobs.add_argument("--address", default=None)
    jobs.set_defaults(func=_cmd_jobs)

    cancel = sub.add_parser("cancel", help="stop a job (by its name or a pipeline's); its GPUs go back")
    cancel.add_argument("name")
    cancel.add_argument("--wait", type=float, default=60.0, help="seconds to wait for it to end (default: 60)")
    cancel.add_argument("--address", default=None)
    cancel.set_defaults(func=_cmd_cancel)

    logs = sub.add_parser("logs", help="print a job's log (its driver's output)")
    logs.add_argument("name")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    logs.add_argument("--address", default=None)
    logs.set_defaults(func=_cmd_logs)

    serve = sub.add_parser("serve", help="serve one model with the embedded engine (vLLM's HTTP API)")
    serve.add_argument("--model", required=True, help="model preset name or local checkpoint dir")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="bearer token for /v1, /inference and control endpoints (default: RLIX_API_KEY; "
                            "prefer the variable: a command line is visible to every user of the machine). "
                            "Without one the OpenAI API is open (as vLLM's) and the control endpoints are "
                            "refused")
    serve.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    serve.add_argument("--dtype", default=None, help="weights dtype, e.g. bfloat16 (default: the checkpoint's)")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together")
    serve.add_argument("--max-model-len", type=int, default=None, help="context length (default: model's)")
    serve.add_argument("--served-model-name", default=None, help="name in the API (default: --model)")
    serve.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="split the model over this many GPUs from --device's on (CUDA; on the CPU, this "
                            "many processes); rlix serve starts and ends the other ranks' processes")
    serve.add_argument("--capture-graphs", action="store_true",
                       help="on CUDA, capture every decode and prefill CUDA graph before serving (a longer "
                            "start; no request waits for a capture later)")
    serve.add_argument("--record-generations", default=None, metavar="DIR",
                       help="append each token-level generate (prompt and sampled ids, logprobs) to "
                            "DIR/generations-PID.jsonl: the engine's own record, for audits")
    serve.add_argument("--max-body-mib", type=float, default=4.0,
                       help="larger request bodies get 413 unread (default: 4)")
    _store_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    export = sub.add_parser("export", help="write a trainer checkpoint as a Hugging Face model folder")
    export.add_argument("checkpoint", help="a checkpoint (RUN_DIR/NAME/checkpoint/step-NNNNNN), or a pipeline's "
                                           "folder or checkpoint/ folder: its newest checkpoint")
    export.add_argument("dest", help="the folder to write (absent or empty)")
    export.add_argument("--model", default=None,
                        help="the run's model folder, for a sharded checkpoint's config and tokenizer "
                             "(default: the one its trainer.json names)")
    export.set_defaults(func=_cmd_export)

    router = sub.add_parser("router", help="route requests over engine servers you started (rlix serve, vLLM)")
    router.add_argument("--shard", action="append", default=[], metavar="[RANK=]URL",
                        help="an engine server's base URL; repeat for each (ranks in order unless given)")
    router.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    router.add_argument("--port", type=int, default=8100)
    router.add_argument("--api-key", default=None,
                        help="token for the admin API (default: RLIX_API_KEY; prefer the variable: a command "
                             "line is visible to every user of the machine)")
    router.add_argument("--shard-api-key", default=None,
                        help="token the shards expect (default: RLIX_SHARD_API_KEY, else the admin token)")
    router.add_argument("--hold-timeout", type=float, default=60.0,
                        help="seconds a request waits while no shard is active (default: 60)")
    router.add_argument("--max-body-mib", type=float, default=4.0,
                        help="larger request bodies get 413 unread (default: 4)")
    _store_flags(router)
    router.set_defaults(func=_cmd_router)
    return parser


def _store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--responses-store-max", type=int, default=DEFAULT_MAX_RESPONSES,
                        help="responses /v1/responses keeps for previous_response_id and GET (least recently "
                             f"used evicted; 0: none; default: {DEFAULT_MAX_RESPONSES})")
    parser.add_argument("--responses-store-mib", type=float, default=DEFAULT_MAX_BYTES / 2**20,
                        help="MiB of JSON those responses and their conversations may take "
                             f"(default: {DEFAULT_MAX_BYTES // 2**20})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env.join_ray_with_token()  # before Ray is imported: it reads the mode once
    env.keep_ray_on_loopback()  # likewise: a Ray started here binds 127.0.0.1 only
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("rlix: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `rlix sim --json | head`: the reader left; nothing more to say
        _silence_stdout()
        return 0
    except Exception as exc:  # noqa: BLE001 - every error is one line; --debug shows the traceback
        if args.debug:
            raise
        print(f"rlix: error: {error_line(exc)}", file=sys.stderr)
        return 2


def error_line(exc: BaseException) -> str:
    """One line for any error: ours as they are; anything else with its type and a hint."""
    text = " ".join(str(exc).split())
    if isinstance(exc, RlixError):
        return text
    return f"{type(exc).__name__}: {text} (an rlix bug or an environment problem; rerun with --debug " \
           f"for the traceback)"


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
