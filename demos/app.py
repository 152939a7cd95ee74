"""mmspec's Gradio demo: one tab per modality, baseline and a chosen method side by side (and a
streaming video tab whose chunks appear as they are decoded). The AR image and continuous-token
tabs share the class prompts and the classifier's quality figure.

    make demo            # or: mmspec demo [--host 127.0.0.1] [--port 7860]
    python demos/app.py

The module defines ``demo`` (a ``gr.Blocks``) and does not launch at import. Models load from
``assets/`` on the first request, once, and every user shares them (``mmspec.serve.Models``);
model events go through one queue that runs at most ``CONCURRENCY`` of them at a time. The VLM
tab's "Answer in a shared batch" sends the request to ``SHARED`` (``serve.SharedQueue``), where the
requests of every user waiting at that moment are decoded together by continuous batching. The
server listens on 127.0.0.1 unless ``--host`` says otherwise.

Method dropdowns and knob inputs come from the method registry (``mmspec.methods``), so a new
method shows up here by itself. The tabs are the served modalities' (``mmspec.serve.SPECS``, each
spec's ``demo_tab``: a ``*_tab()`` builder below or one in another module), so a new modality's tab
comes with its spec; what the tabs draw beside the outputs (the per-token picture, the frame strip,
the stats lines) is in ``demos/render.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import gradio as gr

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demos import render  # noqa: E402
from mmspec import methods, serve  # noqa: E402
from mmspec.core.errors import check, is_int  # noqa: E402

log = logging.getLogger("mmspec.demo")

# model events running at once, over all tabs (one shared concurrency_id); 2 cores here
CONCURRENCY = int(os.environ.get("MMSPEC_DEMO_CONCURRENCY", "2"))
QUEUE_SIZE = 64  # waiting requests beyond this are refused with a message, not queued forever
MODELS = serve.Models()
# the VLM tab's "Answer in a shared batch": users' requests decoded together (continuous batching)
SHARED = serve.SharedQueue(MODELS, slots=int(os.environ.get("MMSPEC_DEMO_SLOTS", "4")), window_s=0.1)
SHARED_WAITERS = 16  # shared-batch events waiting at once (they wait on SHARED's one worker, not on a core)
SCENES = 8  # bundled procedural scenes offered in the VLM tab
VIDEO_MAX_FRAMES = 960  # per demo request (320 chunks of the bundled model); batch takes longer ones
VIDEO_UPDATE_SECONDS = 0.25  # streamed video updates at most this often (the last chunk always shows)
# every image fills its box, pixels scaled nearest-neighbour (the bundled models draw 32-64 pixels)
PIXELS = ["mmspec-pixels"]
PIXELS_CSS = (".mmspec-pixels img { width: 100% !important; height: 100% !important; "
              "object-fit: contain !important; image-rendering: pixelated; }")
CLIP_DIR = Path(tempfile.gettempdir()) / "mmspec-demo"  # a finished clip, until gradio has copied it to its cache


# ---------------------------------------------------------------- shared pieces

def _error(err: Exception) -> str:
    """A readable message for the page: a bad input says what is wrong; anything else is logged
    with its traceback on the server and shown as one line."""
    if isinstance(err, ValueError):
        return f"**Error:** {err}"
    log.exception("demo request failed")
    return f"**Internal error** ({type(err).__name__}): {err}"


def _knob_inputs(kind: str, prefix: str, method: str) -> dict[str, gr.components.Component]:
    """One input per knob any method of ``kind`` takes, shown only for the selected ``method``."""
    shown = serve.method_defaults(kind, method)
    comps = {}
    for name, spec in serve.knob_specs(kind).items():
        label, info = name, (spec.doc.replace("``", "")[:160] + f" ({spec.allowed()})")
        common = dict(label=label, info=info, visible=name in shown, elem_id=f"{prefix}-knob-{name}")
        if spec.choices is not None:
            comps[name] = gr.Dropdown(choices=list(spec.choices), value=shown.get(name, spec.default), **common)
        elif spec.type is bool:
            comps[name] = gr.Checkbox(value=shown.get(name, spec.default), **common)
        elif spec.type is str:
            comps[name] = gr.Textbox(value=shown.get(name, spec.default), **common)
        else:  # int or float; an empty optional knob means None
            comps[name] = gr.Number(value=shown.get(name, spec.default), precision=0 if spec.type is int else None, **common)
    return comps


def _show_knobs(kind: str, names: list[str]):
    """The method-change handler: show the method's knobs with its defaults, hide the others."""
    def update(method):
        try:
            defaults = serve.method_defaults(kind, method)
        except ValueError:
            defaults = {}
        return [gr.update(visible=n in defaults, value=defaults.get(n)) if n in defaults else gr.update(visible=False)
                for n in names]
    return update


def _collect_knobs(kind: str, method: str, names: list[str], values) -> dict:
    """The selected method's knobs from the inputs (ints from number boxes arrive as floats)."""
    mine = methods.knobs(kind, method)
    knobs = {}
    for name, value in zip(names, values):
        if name not in mine:
            continue
        spec = mine[name]
        if spec.type is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if value is None and not spec.optional:
            raise ValueError(f"{name} must be {spec.allowed()}, got an empty box")
        knobs[name] = value
    return knobs


def _int(value, name: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    check(is_int(value), name, "an int", value)
    return value


# ---------------------------------------------------------------- AR image

AR_EMPTY = (None, None, None, "", "", "")


def _side_by_side(kind: str, run, prompt, method, seed, guidance_scale, knob_values):
    """Baseline ``none`` and ``method`` on one seed through ``run`` (``serve.run_ar`` or
    ``serve.run_continuous``) -> (baseline result, method result, lossless/lossy note with the
    classifier's probability of the requested class for both). Raises on bad input."""
    names = list(serve.knob_specs(kind))
    seed = serve.check_seed(_int(seed, "seed"))
    knobs = _collect_knobs(kind, method, names, knob_values)
    recipe = serve.resolve(kind, method, knobs)
    cfg = float(guidance_scale if guidance_scale is not None else 1.0)
    with serve.GAUGE:
        base = run(MODELS, [prompt], [seed], "none", {}, guidance_scale=cfg)[0]
        ours = base if method == "none" else run(MODELS, [prompt], [seed], method, knobs, guidance_scale=cfg)[0]
        quality = serve.class_confidence(MODELS, [base.image, ours.image], [prompt, prompt])
    lossless = "lossless" if (recipe.lossless if recipe is not None else ours.extra["lossless"]) else "**lossy**"
    note = (f"{method}: {lossless}. Quality: classifier p(requested class) = {quality[1]:.3f} "
            f"(baseline {quality[0]:.3f})")
    if "auto" in ours.stats:  # method="auto": what it chose and why
        note += f"\n\n{ours.stats['auto']}"
    return base, ours, note


def ar_generate(prompt, method, seed, guidance_scale, *knob_values):
    """Baseline and ``method`` on the same seed -> (baseline image, method image, per-token picture,
    baseline stats, method stats + lossless/lossy note, error)."""
    try:
        base, ours, note = _side_by_side("ar-image", serve.run_ar, prompt, method, seed, guidance_scale, knob_values)
    except Exception as err:  # shown in the page, never as a dead page
        return (*AR_EMPTY[:5], _error(err))
    if ours.commit_pass is not None:
        grid = render.commit_grid_image(ours.commit_pass)
        passes = int(ours.commit_pass.max()) + 1
        grid_note = (f"{passes} passes for 256 tokens: cells of one colour were committed by one target pass "
                     "(white: the prefill's token)")
    else:
        grid, grid_note = None, "the per-token picture is not available for ZipAR's next-set schedule yet"
    base_md = f"**baseline (none)** - {render.stats_line(base.stats)}"
    ours_md = f"**{method}** - {render.stats_line(ours.stats, base.stats)}\n\n{note}\n\n{grid_note}"
    return base.image, ours.image, grid, base_md, ours_md, ""


def _class_prompt_inputs(kind: str, prefix: str, default: str):
    """The input column of a class-prompt tab (AR image, continuous tokens): prompt, method of the
    registry's ``kind`` modality (``default`` first), seed, CFG scale, the method's knobs and the
    run button, with element ids ``{prefix}-prompt`` etc."""
    names = methods.auto.method_names(kind, methods.names(kind))  # "auto" first where the kind has it
    prompt = gr.Dropdown(list(serve.ar_prompts()), value=serve.ar_prompts()[0], label="class prompt",
                         elem_id=f"{prefix}-prompt")
    first = default if default in names else names[0]
    method = gr.Dropdown(list(names), value=first, label="method", elem_id=f"{prefix}-method")
    with gr.Row():
        seed = gr.Number(value=0, precision=0, label="seed", elem_id=f"{prefix}-seed")
        cfg = gr.Number(value=2.0, label="CFG scale", elem_id=f"{prefix}-cfg")
    with gr.Accordion("method knobs (the papers' defaults)", open=True):
        knobs = _knob_inputs(kind, prefix, first)
    run = gr.Button("Generate", variant="primary", elem_id=f"{prefix}-run")
    return prompt, method, seed, cfg, knobs, run


def ar_tab():
    with gr.Row():
        with gr.Column(scale=1):
            prompt, method, seed, cfg, knobs, run = _class_prompt_inputs("ar-image", "ar", "gsd")
        with gr.Column(scale=2):
            error = gr.Markdown("", elem_id="ar-error")
            with gr.Row():
                base_img = gr.Image(label="baseline", format="png", height=192, interactive=False,
                                    elem_classes=PIXELS, elem_id="ar-base-img")
                ours_img = gr.Image(label="method", format="png", height=192, interactive=False,
                                    elem_classes=PIXELS, elem_id="ar-ours-img")
                grid_img = gr.Image(label="pass per token", format="png", height=192, elem_classes=PIXELS,
                                    interactive=False, elem_id="ar-grid-img")
            base_stats = gr.Markdown("", elem_id="ar-base-stats")
            ours_stats = gr.Markdown("", elem_id="ar-ours-stats")
    knob_list = list(knobs.values())
    method.change(_show_knobs("ar-image", list(knobs)), inputs=method, outputs=knob_list, queue=False)
    run.click(ar_generate, inputs=[prompt, method, seed, cfg, *knob_list],
              outputs=[base_img, ours_img, grid_img, base_stats, ours_stats, error], api_name="ar_generate",
              concurrency_limit=CONCURRENCY, concurrency_id="models")


# ---------------------------------------------------------------- continuous tokens

CONTINUOUS_EMPTY = (None, None, "", "", "")


def continuous_generate(prompt, method, seed, guidance_scale, *knob_values):
    """Baseline ``none`` and ``method`` on the same seed through the continuous-token pipeline ->
    (baseline image, method image, baseline stats, method stats + lossless/lossy note, error)."""
    try:
        base, ours, note = _side_by_side("continuous", serve.run_continuous, prompt, method, seed, guidance_scale,
                                         knob_values)
    except Exception as err:  # shown in the page, never as a dead page
        return (*CONTINUOUS_EMPTY[:4], _error(err))
    if ours.extra["head"] != base.extra["head"]:  # the wall-clock ratio then also compares two heads
        note += (f"\n\n{method} decodes with the {ours.extra['head']} head, the baseline with the "
                 f"{base.extra['head']} head (none-diffusion is the {ours.extra['head']} head's own baseline)")
    base_md = f"**baseline (none)** - {render.stats_line(base.stats)}"
    ours_md = f"**{method}** - {render.stats_line(ours.stats, base.stats)}\n\n{note}"
    return base.image, ours.image, base_md, ours_md, ""


def continuous_tab():
    with gr.Row():
        with gr.Column(scale=1):
            prompt, method, seed, cfg, knobs, run = _class_prompt_inputs("continuous", "cont", "sjd")
        with gr.Column(scale=2):
            error = gr.Markdown("", elem_id="cont-error")
            with gr.Row():
                base_img = gr.Image(label="baseline", format="png", height=192, interactive=False,
                                    elem_classes=PIXELS, elem_id="cont-base-img")
                ours_img = gr.Image(label="method", format="png", height=192, interactive=False,
                                    elem_classes=PIXELS, elem_id="cont-ours-img")
            base_stats = gr.Markdown("", elem_id="cont-base-stats")
            ours_stats = gr.Markdown("", elem_id="cont-ours-stats")
    knob_list = list(knobs.values())
    method.change(_show_knobs("continuous", list(knobs)), inputs=method, outputs=knob_list, queue=False)
    run.click(continuous_generate, inputs=[prompt, method, seed, cfg, *knob_list],
              outputs=[base_img, ours_img, base_stats, ours_stats, error], api_name="continuous_generate",
              concurrency_limit=CONCURRENCY, concurrency_id="models")


# ---------------------------------------------------------------- VLM

def _scene_choices() -> list[str]:
    return [f"scene {i}" for i in range(SCENES)]


def pick_scene(choice):
    try:
        return serve.scene(int(str(choice).split()[-1]))
    except Exception as err:
        raise gr.Error(str(err))


def vlm_answer(image, question, method, max_new_tokens, *knob_values):
    """Streams (answer pieces, baseline stats, method stats, error) as the method decodes."""
    try:
        image, question, knobs, max_new = _check_vlm_inputs(image, question, method, max_new_tokens, knob_values)
    except Exception as err:
        yield None, "", "", _error(err)
        return
    with serve.GAUGE:
        try:
            ours = None
            for partial, result in serve.stream_vlm(MODELS, image, question, 0, method, knobs, max_new):
                ours = result
                if result is None:  # the answer so far, drafted words marked as they are accepted
                    done = len(partial.tokens)
                    yield (render.vlm_pieces(MODELS, partial.tokens, partial.commit_pass), "",
                           f"**{method}** decoding ... {done} tokens so far", "")
            base = ours if method == "none" else serve.run_vlm(MODELS, [image], [question], [0], "none", {}, max_new)[0]
        except Exception as err:
            yield None, "", "", _error(err)
            return
    pieces = render.vlm_pieces(MODELS, ours.tokens, ours.commit_pass)
    drafted = sum(1 for _, label in pieces if label == "draft")
    yield (pieces, *_vlm_stats(method, ours, base, f"{drafted} of {len(pieces)} words came from accepted drafts "
                                                   "(marked)."), "")


def _vlm_stats(method: str, ours, base, note: str) -> tuple[str, str]:
    """(baseline stats, method stats + ``note`` + whether the greedy answers are equal + auto's reason)."""
    same = "yes, token for token" if ours.tokens == base.tokens else "**NO: the answers differ**"
    ours_md = (f"**{method}** - {render.stats_line(ours.stats, base.stats)}\n\n{note} "
               f"Greedy answer equal to the baseline's: {same}")
    if "auto" in ours.stats:  # method="auto": what it chose and why
        ours_md += f"\n\n{ours.stats['auto']}"
    return f"**baseline (none)** - {render.stats_line(base.stats)}", ours_md


def _check_vlm_inputs(image, question, method, max_new_tokens, knob_values):
    """The VLM tab's inputs checked -> (image, question, knobs, max_new_tokens); raises ValueError."""
    image = serve.as_rgb(image)
    knobs = _collect_knobs("vlm", method, list(serve.knob_specs("vlm")), knob_values)
    serve.resolve("vlm", method, knobs)
    max_new = _int(max_new_tokens, "max_new_tokens")
    question = question if isinstance(question, str) else ""
    if not question.strip():
        raise ValueError("question must be a non-empty question about the image, got an empty box")
    return image, question, knobs, max_new


def vlm_shared(image, question, method, max_new_tokens, *knob_values):
    """The answer decoded in a batch shared with other users' requests (``serve.SharedQueue``:
    continuous batching, no token streaming) -> (answer pieces, baseline stats, method stats, error).
    The baseline goes through the same queue (batched with other users' baselines)."""
    try:
        image, question, knobs, max_new = _check_vlm_inputs(image, question, method, max_new_tokens, knob_values)
        ours_f = SHARED.submit(image, question, 0, method, knobs, max_new)
        base_f = ours_f if method == "none" else SHARED.submit(image, question, 0, "none", {}, max_new)
        ours, base = ours_f.result(), base_f.result()
    except Exception as err:
        return None, "", "", _error(err)
    note = (f"Decoded in a shared batch of {ours.stats['group']} requests ({ours.stats['batch']} rows at once, a "
            f"finished answer's row refilled by the next request); waited {ours.stats['queued_seconds']:.2f} s for "
            "its batch.")
    return (render.vlm_pieces(MODELS, ours.tokens, ours.commit_pass), *_vlm_stats(method, ours, base, note), "")


def vlm_tab():
    names = methods.auto.method_names("vlm", methods.names("vlm"))
    with gr.Row():
        with gr.Column(scale=1):
            scene = gr.Dropdown(_scene_choices(), value="scene 0", label="bundled scene (or upload below)",
                                elem_id="vlm-scene")
            image = gr.Image(value=serve.scene(0), label="image", format="png", type="numpy", height=192,
                             elem_classes=PIXELS, elem_id="vlm-image")
            question = gr.Textbox("describe the image in detail .", label="question", elem_id="vlm-question")
            first = "vispec" if "vispec" in names else names[0]
            method = gr.Dropdown(list(names), value=first, label="method", elem_id="vlm-method")
            max_new = gr.Number(value=64, precision=0, label="max new tokens", elem_id="vlm-max-new")
            with gr.Accordion("method knobs", open=False):
                knobs = _knob_inputs("vlm", "vlm", first)
            with gr.Row():
                run = gr.Button("Answer", variant="primary", elem_id="vlm-run")
                shared = gr.Button("Answer in a shared batch", elem_id="vlm-shared")
        with gr.Column(scale=2):
            error = gr.Markdown("", elem_id="vlm-error")
            answer = gr.HighlightedText(label="answer (highlighted: tokens from accepted drafts)",
                                        color_map={"draft": "#7fd17f"}, show_legend=True, elem_id="vlm-answer")
            base_stats = gr.Markdown("", elem_id="vlm-base-stats")
            ours_stats = gr.Markdown("", elem_id="vlm-ours-stats")
    knob_list = list(knobs.values())
    scene.change(pick_scene, inputs=scene, outputs=image, queue=False)
    method.change(_show_knobs("vlm", list(knobs)), inputs=method, outputs=knob_list, queue=False)
    run.click(vlm_answer, inputs=[image, question, method, max_new, *knob_list],
              outputs=[answer, base_stats, ours_stats, error], api_name="vlm_answer",
              concurrency_limit=CONCURRENCY, concurrency_id="models")
    # decoded by SHARED's one worker with other users' requests: these events only wait on it
    shared.click(vlm_shared, inputs=[image, question, method, max_new, *knob_list],
                 outputs=[answer, base_stats, ours_stats, error], api_name="vlm_shared",
                 concurrency_limit=SHARED_WAITERS, concurrency_id="shared")


# ---------------------------------------------------------------- streaming video

VIDEO_EMPTY = (None, None, "", None, "")


def _video_progress(pieces: list, total: int) -> str:
    last = pieces[-1]
    end = last.start + len(last.frames)
    return (f"frame {end} of {total} ({len(pieces)} chunks) | prompt: *{last.prompt}* | "
            f"last chunk {1000 * last.stats['latency_s']:.0f} ms | cache {last.stats['cache_frames']} frames")


def _video_view(pieces: list, total: int):
    """(latest frame 8x, a strip of each chunk's first frame, the progress line)."""
    latest = pieces[-1].frames[-1]
    return (latest.repeat(8, 0).repeat(8, 1), render.frame_strip([p.frames[0] for p in pieces], per_row=16),
            _video_progress(pieces, total))


def video_generate(prompt, switch_prompt, switch_frame, num_frames, method, seed, *knob_values):
    """Streams (latest frame, frame strip, progress, clip, stats, error): the view updates as
    chunks are decoded, then the MP4 clip and the stream's stats."""
    names = list(serve.knob_specs("video"))
    try:
        knobs = _collect_knobs("video", method, names, knob_values)
        frames = _int(num_frames, "frames")
        if not 1 <= frames <= VIDEO_MAX_FRAMES:
            raise ValueError(f"frames must be an int in [1, {VIDEO_MAX_FRAMES}] in the demo, got {frames}")
        switches = []
        if isinstance(switch_prompt, str) and switch_prompt.strip():
            switches = [(_int(switch_frame, "switch frame"), switch_prompt)]
        stream = serve.stream_video(MODELS, prompt, _int(seed, "seed"), frames, method, knobs, switches)
    except Exception as err:
        yield (*VIDEO_EMPTY, _error(err))
        return
    pieces, shown = [], 0.0
    with serve.GAUGE:
        try:
            for piece, result in stream:
                if piece is None:
                    break
                pieces.append(piece)
                if time.monotonic() - shown >= VIDEO_UPDATE_SECONDS:
                    shown = time.monotonic()
                    yield (*_video_view(pieces, frames), None, "", "")
            clip = serve.write_video(result.frames, CLIP_DIR / f"video-{uuid.uuid4().hex}.mp4", fps=16, scale=8)
        except Exception as err:
            yield (*VIDEO_EMPTY, _error(err))
            return
    try:
        yield (*_video_view(pieces, frames), str(clip), f"**{method}** - {render.video_stats_line(result.stats)}", "")
    finally:  # gradio copied the clip to its cache when it took this update (or the request is gone)
        clip.unlink(missing_ok=True)


def video_tab():
    names = methods.names("video")
    with gr.Row():
        with gr.Column(scale=1):
            prompt = gr.Textbox("a red circle moving right", label="prompt (a colour, a shape and a direction)",
                                info="red green blue yellow | circle square triangle star | right left up down",
                                elem_id="video-prompt")
            with gr.Row():
                switch_prompt = gr.Textbox("a blue circle moving right", label="switch to (optional: empty for none)",
                                           elem_id="video-switch-prompt")
                switch_frame = gr.Number(value=48, precision=0, label="at frame (a chunk boundary)",
                                         elem_id="video-switch-frame")
            with gr.Row():
                frames = gr.Number(value=96, precision=0, label="frames", elem_id="video-frames")
                seed = gr.Number(value=0, precision=0, label="seed", elem_id="video-seed")
            method = gr.Dropdown(list(names), value=names[0], label="cache mode", elem_id="video-method")
            with gr.Accordion("cache knobs (empty: the model's own)", open=False):
                knobs = _knob_inputs("video", "video", names[0])
            run = gr.Button("Stream", variant="primary", elem_id="video-run")
        with gr.Column(scale=2):
            error = gr.Markdown("", elem_id="video-error")
            progress = gr.Markdown("", elem_id="video-progress")
            with gr.Row():
                latest = gr.Image(label="latest frame", format="png", height=256, elem_classes=PIXELS,
                                  interactive=False, elem_id="video-latest")
                clip = gr.Video(label="clip (MP4)", height=256, interactive=False, elem_id="video-clip")
            strip = gr.Image(label="one frame per chunk", format="png", interactive=False, elem_id="video-strip")
            stats = gr.Markdown("", elem_id="video-stats")
    knob_list = list(knobs.values())
    method.change(_show_knobs("video", list(knobs)), inputs=method, outputs=knob_list, queue=False)
    run.click(video_generate, inputs=[prompt, switch_prompt, switch_frame, frames, method, seed, *knob_list],
              outputs=[latest, strip, progress, clip, stats, error], api_name="video_generate",
              concurrency_limit=CONCURRENCY, concurrency_id="models")


# ---------------------------------------------------------------- the app

def tabs() -> list[tuple[str, object]]:
    """``(title, builder)`` of every served modality with a tab (``mmspec.serve.SPECS``, in their
    order): the spec's ``demo_tab`` names a builder of this module or a ``"module:function"``."""
    from mmspec.utils.refs import is_ref, load_ref

    return [(spec.title, load_ref(spec.demo_tab) if is_ref(spec.demo_tab) else globals()[spec.demo_tab])
            for spec in serve.SPECS.values() if spec.demo_tab is not None]


def build() -> gr.Blocks:
    with gr.Blocks(title="mmspec: speculative decoding for multimodal generation") as blocks:
        gr.HTML(f"<style>{PIXELS_CSS}</style>", padding=False)  # here, not launch(css=): tests launch `demo`
        gr.Markdown("# mmspec\nSpeculative decoding for multimodal generation, on the bundled tiny models "
                    "(CPU). The AR image, VLM and continuous-token tabs run the baseline and the chosen method on the "
                    "same seed; the streaming video tab shows chunks as they are decoded.")
        with gr.Tabs():
            for label, tab in tabs():
                with gr.Tab(label, elem_id=f"tab-{label.lower().replace(' ', '-')}"):
                    tab()
    blocks.queue(default_concurrency_limit=CONCURRENCY, max_size=QUEUE_SIZE)
    return blocks


demo = build()


def launch(host: str = "127.0.0.1", port: int | None = None, **kwargs):
    """Serve ``demo`` on ``host`` (localhost unless asked) and block until interrupted."""
    return demo.launch(server_name=host, server_port=port, **kwargs)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: localhost only)")
    parser.add_argument("--port", type=int, default=None, help="port (default: gradio's, 7860 or the next free)")
    args = parser.parse_args()
    launch(args.host, args.port)
