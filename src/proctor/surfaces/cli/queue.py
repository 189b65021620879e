"""`proctor enqueue | send | listen | job | cancel | keys`: thin commands over proctor.mechanisms.queue.

Each parses, calls one queue service and prints JSON. The queue is `--queue nats://HOST:PORT[,...]`, else
`$PROCTOR_QUEUE`, else `[queue] servers` of config.toml (any nodes of a cluster), else this home's bundled
nats-server (started on 127.0.0.1 with a token only this user reads, if it is not running). TLS, the NKEY
seed and the token come from proctor.mechanisms.queue.connection; see proctor.mechanisms.queue.fleet for the permissions.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from proctor.surfaces.cli.main import main
from proctor.mechanisms.config.load import ConfigError, load_config
from proctor.mechanisms.config.model import QueueSettings
from proctor.home import ensure_home
from proctor.mechanisms.ledger.store import Ledger
from proctor.mechanisms.queue import connection, keys, sender, server
from proctor.services.listen.audit import BatchedAudit
from proctor.mechanisms.queue.envelope import MAX_TTL_S, EnvelopeError, Sealed, unseal
from proctor.mechanisms.queue.jetstream import JetStreamBackend
from proctor.services.listen.kinds import NoopRunner, ProcessAgentRunner
from proctor.services.listen.listener import Listener, Settings
from proctor.mechanisms.queue.sent import SentStore
from proctor.mechanisms.queue.signers import TrustFileError, TrustStore, load_trust
from proctor.mechanisms.queue.store import JobStore
from proctor.mechanisms.terminal import visible

queue_option = click.option("--queue", "queue_url", envvar="PROCTOR_QUEUE",
                            help="NATS URL of a shared server (else $PROCTOR_QUEUE, else the bundled local one).")


def fail(message: str) -> NoReturn:
    click.echo(f"proctor: {visible(message)}", err=True)
    sys.exit(2)


def queue_settings(config_file: str | None = None) -> QueueSettings:
    try:
        return load_config(config_file).queue
    except ConfigError as exc:
        fail(str(exc))


def resolve_queue(explicit: str | None, config_file: str | None = None) -> str:
    """`--queue`/`$PROCTOR_QUEUE`, else `[queue] servers` of the config, else the bundled local server."""
    try:
        return connection.servers(explicit, queue_settings(config_file), ensure_home())
    except server.ServerError as exc:
        fail(str(exc))


async def connect(url: str, config_file: str | None = None, **options: Any) -> JetStreamBackend:
    settings = queue_settings(config_file)
    try:
        options = {**connection.options(url, settings, ensure_home()), **options}
    except connection.QueueConnectionError as exc:
        fail(str(exc))
    if settings.replicas is not None:
        options.setdefault("replicas", settings.replicas)
    if settings.manage is not None:
        options.setdefault("manage", settings.manage)
    elif "nkeys_seed" in options:
        options.setdefault("manage", False)  # a fleet user may not create streams: its admin does
    if settings.name and "nkeys_seed" in options:
        options.setdefault("inbox_prefix", f"_INBOX_{settings.name}".encode())
    try:
        return await JetStreamBackend.connect(url, **options)
    except Exception as exc:  # noqa: BLE001 - any connect failure is one clear message at the edge
        fail(f"cannot reach the queue at {url}: {exc}")


def parse_lanes(spec: str) -> dict[str, int]:
    lanes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, slots = part.partition("=")
        try:
            lanes[name] = int(slots or "1")
        except ValueError:
            fail(f"--lanes entry {part!r} must be NAME or NAME=SLOTS")
    return lanes


def _load_payload(payload_file: str) -> Any:
    try:
        text = sys.stdin.read() if payload_file == "-" else Path(payload_file).read_text(encoding="utf-8")
        return json.loads(text)
    except (OSError, ValueError) as exc:
        fail(f"payload file {payload_file!r}: {exc}")


def _signer(name: str) -> keys.Ed25519Signer | keys.HmacKey:
    try:
        return keys.load(name)
    except keys.KeyFileError as exc:
        fail(str(exc))


def _check_ttl(_ctx: Any, _param: Any, value: float) -> float:
    if not math.isfinite(value) or value < 1:
        raise click.BadParameter(f"must be a finite number of seconds >= 1, not {value}")
    if value > MAX_TTL_S:
        raise click.BadParameter(f"an envelope lives at most {MAX_TTL_S} seconds (7 days), not {value:.0f}")
    return value


def job_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--targets", help="Comma-separated host names; one job per host."),
        click.option("--kind", default="run_agent", show_default=True, help="Job kind (run_agent, noop)."),
        click.option("--lane", default="default", show_default=True, help="Lane on the target host."),
        click.option("--payload-file", help="JSON payload (a run_agent request); - for stdin."),
        click.option("--envelope-file", help="Instead of --targets and --payload-file: an envelope already signed "
                                             "({v, alg, body, sig}, as POST /v1/jobs takes it), queued as it is; "
                                             "the same one again is reported as DUPLICATE, not queued twice."),
        click.option("--key", "key_name", default=keys.SENDER_KEY, show_default=True, help="Signing key name."),
        click.option("--ttl", "ttl_s", default=sender.DEFAULT_TTL_S, show_default=True, type=float,
                     callback=_check_ttl, help="Seconds until the job expires unstarted."),
        queue_option,
    ]):
        f = opt(f)
    return f


def _jobs(targets: str | None, kind: str, lane: str, payload_file: str | None, envelope_file: str | None,
          key_name: str, ttl_s: float) -> list[Sealed]:
    """The envelopes to queue: signed here from the flags, or the one in --envelope-file as it is."""
    if envelope_file is None:
        if not targets or not payload_file:
            fail("--targets and --payload-file are required (or --envelope-file with an envelope signed already)")
        built = sender.build(targets=[t.strip() for t in targets.split(",") if t.strip()], kind=kind, lane=lane,
                             payload=_load_payload(payload_file), signer=_signer(key_name), ttl_s=ttl_s)
        if isinstance(built, sender.Rejected):
            fail("job rejected:\n  " + "\n  ".join(built.errors))
        return built
    ctx = click.get_current_context()
    given = [f"--{n.replace('_', '-')}" for n in ("targets", "payload_file", "kind", "lane", "key_name", "ttl_s")
             if ctx.get_parameter_source(n) not in (ParameterSource.DEFAULT, None)]
    if given:
        fail(f"--envelope-file is queued as it was signed; {', '.join(given)} cannot change it")
    try:
        raw = Path(envelope_file).read_bytes() if envelope_file != "-" else sys.stdin.buffer.read()
    except OSError as exc:
        fail(f"envelope file {envelope_file!r}: {exc.strerror or exc}")
    env = unseal(raw)
    if isinstance(env, EnvelopeError):
        fail(f"envelope file {envelope_file!r}: {env.code}: {env.reason}")
    sealed = Sealed(env.alg, env.body, env.sig)
    problems = sender.resend_problems(sealed)
    if problems:
        fail("job rejected:\n  " + "\n  ".join(problems))
    return [sealed]


async def _enqueue(url: str, sealed: list[Sealed]) -> list[sender.Enqueued]:
    store = SentStore()
    for s in sealed:
        reused = sender.reused_id(s, store)
        if reused is not None:
            fail(f"{reused.code}: {reused.message}")
    backend = await connect(url)
    try:
        jobs = [await sender.publish(backend, s, sent=store) for s in sealed]
    except Exception as exc:  # noqa: BLE001 - a broker that refuses or times out is one clear message
        fail(f"could not enqueue on the queue at {url}: {type(exc).__name__}: {exc}")
    finally:
        await backend.close()
    for job in jobs:
        if job.duplicate:
            click.echo(f"proctor: {visible(job.notice())}", err=True)
    return jobs


@main.command("enqueue")
@job_options
def enqueue_cmd(targets, kind, lane, payload_file, envelope_file, key_name, ttl_s, queue_url) -> None:
    """Sign and enqueue a job for each target; print one job id per line. Exit 3 when the queue already
    had the envelope (DUPLICATE, on stderr): nothing was queued again, its job id is still printed."""
    sealed = _jobs(targets, kind, lane, payload_file, envelope_file, key_name, ttl_s)
    jobs = asyncio.run(_enqueue(resolve_queue(queue_url), sealed))
    for job in jobs:
        click.echo(job.job_id)
    sys.exit(3 if any(job.duplicate for job in jobs) else 0)


@main.command("send")
@job_options
@click.option("--wait", "wait_s", default=14_400 + 600, show_default=True, type=float, help="Seconds to wait.")
def send_cmd(targets, kind, lane, payload_file, envelope_file, key_name, ttl_s, queue_url, wait_s) -> None:
    """Enqueue like `enqueue`, wait for each signed result, print them; exit 0 iff all completed. An envelope
    the queue already had (DUPLICATE, on stderr and in its output) is not queued again: the result waited
    for is the first copy's, which is this envelope's own answer."""
    sealed = _jobs(targets, kind, lane, payload_file, envelope_file, key_name, ttl_s)
    url = resolve_queue(queue_url)
    trust = _trust()

    async def go() -> tuple[list[dict[str, Any]], bool]:
        jobs = await _enqueue(url, sealed)
        backend = await connect(url)
        try:
            outs, ok = [], True
            for job in jobs:
                job_id = job.job_id
                dup = {"code": job.code, "notice": job.notice()} if job.duplicate else {}
                # Bound to the envelope just sent (its digest and the host it named), never to a record.
                res = await sender.wait(backend, trust, job, wait_s)
                if res is None:
                    outs.append({"jobId": job_id, "state": "waiting", "error": f"no result in {wait_s:.0f}s", **dup})
                    ok = False
                    continue
                view = sender.result_view(res)
                outs.append({"jobId": job_id, **view, **dup})
                ok = ok and not isinstance(res, EnvelopeError) and res.result.status.value == "completed"
            return outs, ok
        finally:
            await backend.close()

    outs, ok = asyncio.run(go())
    click.echo(json.dumps(outs[0] if len(outs) == 1 else outs, indent=2))
    sys.exit(0 if ok else 1)


def _trust() -> TrustStore:
    try:
        return load_trust()
    except TrustFileError as exc:
        fail(str(exc))


def _tally_reach(url: str, host: str, nkey_seed: str | None, config_file: str | None) -> dict[str, str]:
    """How a run_agent job's child reaches the fleet's spend tally: as this listener reaches the queue."""
    seed = nkey_seed or queue_settings(config_file).nkey_seed
    return {"url": url, **({"nkey_seed": str(Path(seed).expanduser().absolute()), "inbox": f"_INBOX_{host}"}
                           if seed else {})}


@main.command("listen")
@click.option("--host", "host", required=True, help="This host's name, as senders target it.")
@click.option("--lanes", default="default=1", show_default=True, help="LANE=SLOTS[,LANE=SLOTS...]")
@click.option("--ack-wait", "ack_wait_s", default=60.0, show_default=True, type=float,
              help="Lease seconds; heartbeats every ack-wait/4 hold it for long jobs.")
@click.option("--config", "config_file", help="Agents config TOML for run_agent jobs.")
@click.option("--nkey-seed", "nkey_seed", type=click.Path(exists=True, dir_okay=False),
              envvar="PROCTOR_QUEUE_NKEY_SEED",
              help="NKEY seed file for a fleet server with per-host permissions.")
@queue_option
def listen_cmd(host, lanes, ack_wait_s, config_file, nkey_seed, queue_url) -> None:
    """Run this host's jobs from its lanes until SIGINT/SIGTERM."""
    url = resolve_queue(queue_url, config_file)
    try:
        settings = Settings(host=host, lanes=parse_lanes(lanes), ack_wait_s=ack_wait_s)
    except ValueError as exc:
        fail(str(exc))
    home = ensure_home()
    trust = _trust()
    try:
        host_key = keys.load_or_generate(keys.HOST_KEY)
        confine = load_config(config_file).confine
    except (keys.KeyFileError, ConfigError) as exc:
        fail(str(exc))
    store = JobStore(home / "queue.sqlite3")
    runners = {
        "noop": NoopRunner(),
        "run_agent": ProcessAgentRunner(store.path, Path(config_file).absolute() if config_file else None,
                                        tally=_tally_reach(url, host, nkey_seed, config_file)),
    }

    async def go() -> None:
        options: dict[str, Any] = {}
        seed = nkey_seed or queue_settings(config_file).nkey_seed
        if seed:
            options = {"nkeys_seed": seed, "inbox_prefix": f"_INBOX_{host}".encode()}
        backend = await connect(url, config_file, **options)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        audit = BatchedAudit(Ledger.default())
        listener = Listener(settings, backend, trust, host_key, store, audit, runners, confine=confine)
        click.echo(json.dumps({"listening": host, "lanes": settings.lanes, "queue": url, "pid": os.getpid()}),
                   err=True)
        try:
            await asyncio.gather(listener.serve(stop), audit.run(stop))
        finally:
            await backend.close()

    asyncio.run(go())


@main.command("job")
@click.argument("job_id")
@queue_option
def job_cmd(job_id, queue_url) -> None:
    """Show a job: where it went, whether it runs, its verified result."""
    url = resolve_queue(queue_url)
    trust = _trust()

    async def go() -> dict[str, Any] | None:
        backend = await connect(url)
        try:
            return await sender.status(backend, trust, job_id)
        finally:
            await backend.close()

    out = asyncio.run(go())
    if out is None:
        fail(f"no job {job_id} on this queue")
    click.echo(json.dumps(out, indent=2))


@main.command("cancel")
@click.argument("job_id")
@click.option("--reason", default="cancelled by the user", show_default=True)
@click.option("--key", "key_name", default=keys.SENDER_KEY, show_default=True,
              help="Key that signs the cancel request: the job's own signer, or one with may_set_validate_command.")
@queue_option
def cancel_cmd(job_id, reason, key_name, queue_url) -> None:
    """Ask the job's host to cancel it: a running job's tree is killed (status failed, code CANCELLED)."""
    url = resolve_queue(queue_url)
    signer = _signer(key_name)

    async def go() -> bool:
        backend = await connect(url)
        try:
            return await sender.cancel(backend, job_id, reason, signer=signer)
        finally:
            await backend.close()

    if not asyncio.run(go()):
        fail(f"no job {job_id} on this queue")
    click.echo(json.dumps({"jobId": job_id, "cancelRequested": reason}))
