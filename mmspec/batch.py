"""``mmspec batch``: resumable batch generation from a file of jobs, scaled out with accelerate.

::

    mmspec batch jobs.jsonl --out out/                                  # one process
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no --main_process_port 0 -m mmspec batch jobs.jsonl --out out/

A job is one JSON object per line (or one CSV row): ``id`` (a file name stem), ``kind`` (a served
modality, ``mmspec.serve.SPECS``: ``"ar-image"``, ``"vlm"``, ``"video"`` or ``"continuous"``),
``method`` (default ``"none"``; ``"rolling"`` for video), ``seed`` (default 0), the kind's inputs
(``prompt`` for ``ar-image`` and ``continuous``; ``image`` (a path, relative to the jobs file) and
``question`` for ``vlm``; ``prompt``, ``frames`` and ``switches`` for ``video``) and options
(``guidance_scale``, ``temperature``, ``max_new_tokens``, ...: its spec's ``job_fields``), and the
method's knobs, flat (``"sjd_window": 16``) or
under ``"knobs"``. Every line is checked first, methods and knobs through the method registry: bad
lines are reported by line number and nothing runs or is written.

Video jobs: ``prompt`` (``"a red circle moving right"``), ``frames`` (default 48), ``switches``
(prompt switches: ``[[24, "a blue circle moving right"], ...]``, or ``"24:a blue circle moving
right; 48:..."`` as text, as ``generate video --switch`` takes them; frames at chunk boundaries),
``format`` (``"mp4"``, default, or ``"gif"``), ``fps`` (16) and ``scale`` (8: the 32 px frames
nearest-neighbour upscaled); the method is a cache mode of the ``"video"`` registry modality
(``rolling``, ``window-recompute``, ``full-cache``, ``no-sink``) with its knobs (``sink_frames``,
``window_frames``, ``recache_sink``, ``num_inference_steps``, ``guidance_scale``).

Continuous jobs: a class prompt (``"a red circle"``, the AR image kind's prompts) through the
continuous-token pipeline (``assets/continuous``), a method of the ``"continuous"`` registry
modality (``none``, ``none-diffusion``, ``sd``, ``sd-warmup``, ``path``, ``cspd``, ``sjd``, ...) with its knobs
(``sd_gamma``, ``cspd_inner_temperature``, ...), ``guidance_scale`` (2.0) and ``temperature``
(1.0, > 0); one PNG each.

Output: ``OUT/<id>.png`` per image, ``OUT/<id>.txt`` per answer, ``OUT/<id>.mp4`` (or ``.gif``)
per video, and ``OUT/manifest.jsonl`` with one record per job: status (``ok`` / ``error``), output
file, stats (for a video: fps, per-chunk latency median and p95, cache frames, switch frames, the
resolved cache settings), error message. Files are written to a temporary name and renamed;
manifest records are appended whole under a file lock; a rerun skips jobs the manifest records as
``ok`` whose file exists, and retries the others. A failing job is recorded with its error and the
rest go on. At the end the main process rewrites the manifest (atomically) with one record per job,
in the jobs file's order.

Jobs are grouped into batches before they are split between processes (``PartialState.
split_between_processes``), and every job draws from its own seed, so the files are the same for
any number of processes. Same-kind jobs share one pipeline call (up to ``batch_size``) only where
that cannot change a job's output (``mmspec.serve.vlm_batchable`` / ``ar_batchable``; video and
continuous jobs run one per call, ``video_batchable`` / ``continuous_batchable``).

``--continuous`` (``run(continuous=True)``): those same-group jobs stream through continuous
batching instead (``mmspec.serve.slots``): ``batch_size`` rows decode at once and a finished job's
row takes the next job's prefill while the others keep decoding; each job's file and record are
written as it finishes (resumable as above). Each group is one stream per process.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import methods, serve
from .core.errors import check, check_int, is_int
from .utils.atomic import atomic_path
from .utils.refs import load_ref

MANIFEST = "manifest.jsonl"
ATOMIC_TMP = re.compile(r"\..+\.[0-9a-f]{8}\.tmp(\.[A-Za-z0-9]+)?")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# ---------------------------------------------------------------- what each kind takes
# a kind's fields, output file and runner: its ``mmspec.serve.ModalitySpec`` (``serve.SPECS``)

COMMON = {"id", "kind", "method", "seed", "knobs"}


@dataclass(frozen=True)
class Job:
    line: int
    id: str
    kind: str
    method: str
    seed: int
    params: dict
    knobs: dict = field(default_factory=dict)

    @property
    def output(self) -> str:
        fmt = self.params.get("format")  # video: mp4 or gif
        return self.id + (f".{fmt}" if fmt else serve.spec(self.kind).output_ext)

    def group(self) -> str:
        """Jobs with the same group may share one pipeline call."""
        spec = serve.spec(self.kind)
        shared = {k: v for k, v in self.params.items() if k not in spec.per_job}
        return json.dumps([self.kind, self.method, self.knobs, shared], sort_keys=True)


# ---------------------------------------------------------------- reading and checking jobs

_WORDS = {int: "an int", float: "a float", str: "a str", bool: "a bool"}


def _switches(name: str, value) -> list[tuple[int, str]]:
    """Prompt switches: ``[[frame, text], ...]`` or ``"FRAME:TEXT; FRAME:TEXT"`` (a CSV cell, like
    ``generate video --switch``) -> ``[(frame, text), ...]``; the schedule is checked later."""
    allowed = "a list of [frame, prompt] pairs, or 'FRAME:PROMPT; FRAME:PROMPT' text"
    if isinstance(value, str):
        pairs = []
        for item in filter(str.strip, value.split(";")):
            frame, sep, text = item.partition(":")
            check(sep == ":" and frame.strip().isdigit(), name, allowed, value)
            pairs.append((int(frame), text.strip()))
        return pairs
    check(isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value), name,
          allowed, value)
    return [tuple(p) for p in value]


def _coerce(name: str, value, typ: type, optional: bool, from_csv: bool):
    """A field's value as ``typ``; CSV cells arrive as text and are parsed here."""
    if typ is list:
        return _switches(name, value)
    if value is None or (from_csv and value == ""):
        check(optional, name, _WORDS[typ], value)
        return None
    if from_csv and typ is not str:
        try:
            value = {"true": True, "false": False}[value.lower()] if typ is bool else typ(value)
        except (ValueError, KeyError):
            raise ValueError(f"{name} must be {_WORDS[typ]}, got {value!r}") from None
    if typ is float and is_int(value):
        value = float(value)
    ok = isinstance(value, typ) and not (typ is not bool and isinstance(value, bool))
    check(ok, name, _WORDS[typ], value)
    return value


def parse_job(raw: dict, line: int, base: Path, from_csv: bool = False) -> Job:
    """One job from a parsed line; ``ValueError`` naming the field otherwise. Images are opened
    here, so an unreadable image fails before any work."""
    check(isinstance(raw, dict), "job", "a JSON object", type(raw).__name__)
    raw = {k: v for k, v in raw.items() if not (from_csv and v == "" and k not in ("id", "kind"))}
    job_id = raw.get("id")
    check(isinstance(job_id, str) and _ID.fullmatch(job_id) is not None, "id",
          "a file-name stem: letters, digits, '.', '_', '-' (at most 128, not starting with '.')", job_id)
    kind = raw.get("kind")
    spec = serve.spec(kind)
    method = raw.get("method", spec.default_method)
    serve.resolve(kind, method, {})  # an unknown method: named, with the allowed ones
    seed = serve.check_seed(_coerce("seed", raw.get("seed", 0), int, False, from_csv))
    params = {}
    for name, f in spec.job_fields.items():
        if name in raw:
            params[name] = _coerce(name, raw[name], f.type, f.optional, from_csv)
        else:
            check(not f.required, name, f"given for a {kind!r} job", None)
            params[name] = f.default
    knobs = dict(raw.get("knobs") or {})
    check(isinstance(knobs, dict), "knobs", "an object of knob values", raw.get("knobs"))
    allowed = methods.knobs(kind, method)
    for key, value in raw.items():
        if key in COMMON or key in spec.job_fields:
            continue
        if from_csv and key in allowed:
            k = allowed[key]
            value = _coerce(key, value, k.type, k.optional, True)
        knobs[key] = value
    serve.resolve(kind, method, knobs)  # unknown knobs, types, ranges: named, with what is allowed
    if spec.check_job is not None:  # the kind's own checks between fields (paths, ranges, schedules)
        spec.check_job(params, method, knobs, base)
    if "temperature" in params:
        check(params["temperature"] >= 0, "temperature", "a number >= 0", params["temperature"])
    return Job(line, job_id, kind, method, seed, params, knobs)


def _rows(path: Path):
    """``(line number, raw job or an error message, from_csv)`` for every non-blank line."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        check(reader.fieldnames is not None and "id" in reader.fieldnames and "kind" in reader.fieldnames,
              "jobs", "a CSV file with a header row naming at least 'id' and 'kind'", reader.fieldnames)
        for row in reader:
            if None in row:
                yield reader.line_num, "more cells than the header has columns", True
            elif any(v for v in row.values()):
                yield reader.line_num, row, True
        return
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line), False
        except json.JSONDecodeError as err:
            yield n, f"not valid JSON ({err.msg} at column {err.colno})", False


def load_jobs(path: str | Path) -> list[Job]:
    """Every job of a ``.jsonl`` (or ``.csv``) file, checked. All bad lines are reported together,
    by line number, in one ``ValueError``."""
    path = Path(path)
    check(path.is_file(), "jobs", "an existing .jsonl or .csv file", str(path))
    check(path.suffix.lower() in (".jsonl", ".json", ".csv"), "jobs", "a .jsonl or .csv file", path.name)
    jobs, errors, seen = [], [], {}
    for n, raw, from_csv in _rows(path):
        try:
            if isinstance(raw, str):
                raise ValueError(raw)
            job = parse_job(raw, n, path.parent, from_csv)
            check(job.id not in seen, "id", f"unique (line {seen.get(job.id)} has it too)", job.id)
            seen[job.id] = n
            jobs.append(job)
        except ValueError as err:
            errors.append(f"{path.name} line {n}: {err}")
    if errors:
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        raise ValueError(f"jobs: {len(errors)} bad line(s), nothing was run:\n  " + "\n  ".join(errors[:20]) + more)
    check(len(jobs) > 0, "jobs", "at least one job", str(path))
    return jobs


# ---------------------------------------------------------------- files and the manifest

def append_record(manifest: Path, record: dict) -> None:
    """Append one JSON line, whole: one ``write`` under an exclusive lock, then fsync."""
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(manifest, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(manifest: Path) -> dict[str, dict]:
    """The latest record per job id; a torn last line (a crash mid-append) is ignored."""
    records = {}
    if manifest.is_file():
        for line in manifest.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                records[rec["id"]] = rec
    return records


def _repair(out: Path) -> None:
    """Before a run: drop a torn manifest tail and temporary files left by a killed run."""
    manifest = out / MANIFEST
    if manifest.is_file():
        with open(manifest, "rb+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            data = fh.read()
            if data and not data.endswith(b"\n"):
                fh.truncate(data.rfind(b"\n") + 1)
    for tmp in out.glob(".*.tmp*"):  # mmspec.utils.atomic's: .<name>.<8 hex>.tmp<suffix>
        if ATOMIC_TMP.fullmatch(tmp.name):
            tmp.unlink(missing_ok=True)


def finished(out: Path, jobs: list[Job]) -> set[str]:
    """Ids of jobs the manifest records as ok whose output file exists."""
    records = read_manifest(out / MANIFEST)
    return {j.id for j in jobs if records.get(j.id, {}).get("status") == "ok" and (out / j.output).is_file()}


# ---------------------------------------------------------------- running

def make_batches(jobs: list[Job], batch_size: int) -> list[list[Job]]:
    """Consecutive groups of same-group jobs, at most ``batch_size`` each, where the kind allows
    sharing a call; in the order of each batch's first job."""
    groups: dict[str, list[Job]] = {}
    batches: list[list[Job]] = []
    for job in jobs:
        spec = serve.spec(job.kind)
        if batch_size > 1 and spec.batchable(job.method, job.params.get("temperature", 0.0)):
            group = groups.setdefault(job.group(), [])
            if not group:
                batches.append(group)
            group.append(job)
            if len(group) == batch_size:
                del groups[job.group()]
        else:
            batches.append([job])
    return batches


def make_streams(jobs: list[Job], slots: int, parts: int = 1) -> list[list[Job]]:
    """``--continuous``: ``make_batches``'s units, where every group of same-group jobs that may
    share a call and whose kind has continuous batching (its spec's ``slot_jobs``) is one *stream* per
    process (the group cut into ``parts`` contiguous runs, so processes share it) instead of
    batches of ``slots``; a stream runs through continuous batching with ``slots`` rows. Other jobs
    are batched as ``make_batches`` does. In the order of each unit's first job."""
    streams: dict[str, list[Job]] = {}
    units: list[list[Job]] = []
    rest: list[Job] = []
    for job in jobs:
        spec = serve.spec(job.kind)
        if spec.slot_jobs is not None and spec.batchable(job.method, job.params.get("temperature", 0.0)):
            group = streams.setdefault(job.group(), [])
            if not group:
                units.append(group)
            group.append(job)
        else:
            rest.append(job)
    out: list[list[Job]] = []
    for group in units:
        size = -(-len(group) // max(1, min(parts, len(group))))
        out.extend(group[i:i + size] for i in range(0, len(group), size))
    batches = make_batches(rest, slots)
    order = {id(j): n for n, j in enumerate(jobs)}
    return sorted(out + batches, key=lambda unit: order[id(unit[0])])


def run_stream(models: serve.Models, stream: list[Job], out: Path, slots: int) -> list[dict]:
    """Run one stream through continuous batching: each job's file and manifest record are
    written as soon as it finishes. If the stream fails, the jobs it had not finished run again
    one by one (``run_batch``), so a bad job fails alone and is recorded with its error."""
    first = stream[0]
    records: list[dict] = []
    pending = set(range(len(stream)))
    try:
        slot_jobs = load_ref(serve.spec(first.kind).slot_jobs)
        results = slot_jobs(models, [j.params for j in stream], [j.seed for j in stream], first.method, first.knobs,
                            slots)
        for index, result in results:
            job = stream[index]
            _write(out, job, result)
            rec = _record(job, "ok", stats=result.stats)
            append_record(out / MANIFEST, rec)
            records.append(rec)
            pending.discard(index)
    except Exception:
        for index in sorted(pending):
            records.extend(run_batch(models, [stream[index]], out))
    return records


def _write(out: Path, job: Job, result: serve.Result) -> None:
    """The job's file, whole or not at all, by what the result holds: frames through the
    pipeline's video writer (which writes a temporary file and renames it), an image as PNG or a
    text written to a temporary file and renamed (``mmspec.utils.atomic``)."""
    if result.frames is not None:
        p = job.params
        serve.write_video(result.frames, out / job.output, fps=p["fps"], scale=p["scale"])
    else:
        with atomic_path(out / job.output) as tmp:
            tmp.write_bytes(_encode(result))


def _encode(result: serve.Result) -> bytes:
    if result.image is not None:
        import PIL.Image

        buf = io.BytesIO()
        PIL.Image.fromarray(result.image).save(buf, format="PNG")
        return buf.getvalue()
    return (result.text + "\n").encode("utf-8")


def _run(models: serve.Models, batch: list[Job]) -> list[serve.Result]:
    first = batch[0]
    return serve.spec(first.kind).run_jobs(models, [j.params for j in batch], [j.seed for j in batch],
                                           first.method, first.knobs)


def _record(job: Job, status: str, stats: dict | None = None, error: str | None = None) -> dict:
    from accelerate import PartialState

    return {"id": job.id, "kind": job.kind, "method": job.method, "seed": job.seed, "status": status,
            "output": job.output if status == "ok" else None, "stats": stats or {}, "error": error,
            "process": PartialState().process_index}


def run_batch(models: serve.Models, batch: list[Job], out: Path) -> list[dict]:
    """Run one batch, write its files and manifest records; a failing batch is retried job by
    job, so one bad job fails alone and is recorded with its error."""
    try:
        results = _run(models, batch)
    except Exception as err:
        if len(batch) > 1:
            return [rec for job in batch for rec in run_batch(models, [job], out)]
        rec = _record(batch[0], "error", error=f"{type(err).__name__}: {err}")
        append_record(out / MANIFEST, rec)
        return [rec]
    records = []
    for job, result in zip(batch, results):
        _write(out, job, result)
        rec = _record(job, "ok", stats=result.stats)
        append_record(out / MANIFEST, rec)
        records.append(rec)
    return records


@dataclass
class Summary:
    total: int
    skipped: int
    ok: int
    failed: int
    processes: int


def run(jobs_path: str | Path, out: str | Path, batch_size: int = 4, progress: bool = True,
        models: serve.Models | None = None, continuous: bool = False) -> Summary:
    """Run every unfinished job of ``jobs_path`` into ``out``, on this process and the others
    accelerate started. Bad job lines raise ``ValueError`` before any folder is made.

    ``continuous``: same-group batchable jobs of a kind with a slot runner stream through
    continuous batching with ``batch_size`` slots (``make_streams``, ``run_stream``): a finished
    job's row is refilled at once, and its file and record are written as it ends."""
    check_int(batch_size, "batch_size", 1)
    check(isinstance(continuous, bool), "continuous", "True or False", continuous)
    jobs = load_jobs(jobs_path)
    out = Path(out)
    check(not out.exists() or out.is_dir(), "out", "a folder (or a path to create one at)", str(out))

    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState(cpu=not torch.cuda.is_available())  # without cpu=True, CPU ranks come up as separate runs
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        _repair(out)
    state.wait_for_everyone()
    done = finished(out, jobs)
    pending = [j for j in jobs if j.id not in done]
    if continuous:
        batches = make_streams(pending, batch_size, state.num_processes)
    else:
        batches = make_batches(pending, batch_size)
    models = models or serve.Models()
    bar = None
    if progress and state.is_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), initial=len(done), desc="mmspec batch", unit="job", file=sys.stderr)
    ids = {j.id for j in pending}
    mine_records: list[dict] = []
    with state.split_between_processes(batches) as mine:
        for batch in mine:
            spec = serve.spec(batch[0].kind)
            streamed = continuous and spec.slot_jobs is not None and spec.batchable(
                batch[0].method, batch[0].params.get("temperature", 0.0))
            mine_records.extend(run_stream(models, batch, out, batch_size) if streamed else
                                run_batch(models, batch, out))
            if bar is not None:  # everyone's progress, read back from the shared manifest
                records = read_manifest(out / MANIFEST)
                now = [records[i] for i in ids if i in records]
                bar.n = len(done) + len(now)
                bar.set_postfix(failed=sum(r["status"] == "error" for r in now), refresh=False)
                bar.refresh()
    gathered = gather_object(mine_records) if state.num_processes > 1 else mine_records
    failed = sum(r["status"] == "error" for r in gathered)
    if state.is_main_process:
        latest = read_manifest(out / MANIFEST)
        lines = "".join(json.dumps(latest[j.id], sort_keys=True) + "\n" for j in jobs if j.id in latest)
        with atomic_path(out / MANIFEST) as tmp:
            tmp.write_bytes(lines.encode())
        if bar is not None:
            bar.n = len(done) + len(gathered)
            bar.set_postfix(failed=failed, refresh=False)
            bar.close()
    state.wait_for_everyone()
    return Summary(len(jobs), len(done), len(gathered) - failed, failed, state.num_processes)
