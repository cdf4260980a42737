"""Cache-DiT (k6serve/caching/): the step masks against cache-dit 1.5.3's, the DBCache decisions and residuals on a
stack of toy blocks, and the real tiny DiT through the pipeline, the resolver, the CLI and the HTTP body parser.

The toy blocks make every quantity exact: block 0 (the Fn block) adds a per-step "fingerprint", so the residual
distance of a step is known; the middle block adds a per-step value, so what a cached step reused is visible.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from k6serve.caching.block_cache import NEGATIVE, POSITIVE, BlockCacheSession, TaylorSeer, block_cache
from k6serve.caching.params import CacheDitParams, parse_cache_dit_config
from k6serve.engine_arguments import build_engine_config
from k6serve.models.variants import VARIANTS
from k6serve.request import OutputOptions, SamplingParams
from k6serve.request_resolution import resolve_generate, resolve_upscale
from k6serve.runtime.worker import ModelWorker

NO_FILE = OutputOptions(save_output=False, return_frames=True)

# cache-dit 1.5.3 `steps_mask(total_steps=n, mask_policy=p)`, computed with the library itself.
CACHE_DIT_MASKS = {
    (8, "slow"): "11111011", (8, "ultra"): "11001001",
    (9, "medium"): "111110101", (9, "fast"): "111101001",
    (10, "slow"): "1111011111", (10, "medium"): "1111011011", (10, "fast"): "1110100101",
    (10, "ultra"): "1101001001",
    (12, "fast"): "111010010011",
    (20, "medium"): "11111101100011000101", (20, "ultra"): "11110000000000000001",
    (28, "slow"): "1111111101110011100110010001", (28, "fast"): "1111110100010000100000100001",
    (50, "slow"): "11111111111111111111110011111000111110001110001101",
    (50, "medium"): "11111111111111110011100000111000001110000011100001",
    (50, "fast"): "11111111111001100000110000000110000000001100000001",
    (50, "ultra"): "11111110001100000000011000000000001100000000000001",
}


@pytest.mark.parametrize(("steps", "preset"), list(CACHE_DIT_MASKS))
def test_preset_masks_are_cache_dits(steps, preset):
    mask = CacheDitParams(scm_preset=preset).steps_mask(steps)
    assert "".join(map(str, mask)) == CACHE_DIT_MASKS[steps, preset]


def test_bin_masks_alternate_compute_and_cache_runs():
    params = CacheDitParams.from_mapping({"scm_compute_bins": [4, 2, 1], "scm_cache_bins": [1, 2]})
    assert params.steps_mask(10) == (1, 1, 1, 1, 0, 1, 1, 0, 0, 1)
    assert params.steps_mask(6) == (1, 1, 1, 1, 0, 1)
    assert CacheDitParams().steps_mask(10) is None


@pytest.mark.parametrize(("values", "message"), [
    ({"Fn_compute_blocks": 0}, r"Fn_compute_blocks must be an integer >= 1 \(the first blocks' residual"),
    ({"max_warmup_steps": 1.5}, r"max_warmup_steps must be an integer >= 0, got 1.5"),
    ({"residual_diff_threshold": -0.1}, r"residual_diff_threshold must be a finite number >= 0"),
    ({"enable_taylorseer": "yes"}, r"enable_taylorseer must be true or false"),
    ({"scm_preset": "turbo"}, r"scm_preset must be one of \('none', 'slow', 'medium', 'fast', 'ultra'\)"),
    ({"scm_policy": "always"}, r"scm_policy must be one of \('dynamic', 'static'\)"),
    ({"scm_compute_bins": [2, 1]}, r"give scm_compute_bins and scm_cache_bins together"),
    ({"scm_compute_bins": [2, 0], "scm_cache_bins": [1]}, r"scm_compute_bins must be a non-empty list of integers"),
    ({"scm_preset": "fast", "scm_compute_bins": [2], "scm_cache_bins": [1]}, r"give one of them"),
    ({"Fn": 1}, r"Unknown cache_dit_params key\(s\) \['Fn'\]. Valid keys: \['Fn_compute_blocks', "),
    # A typo, or another case, names the key it resembles, as a mistyped flag or request field does.
    ({"residual_diff_treshold": 0.1},
     r"\['residual_diff_treshold'\] \(did you mean 'residual_diff_threshold'\?\). Valid keys: "),
    ({"fn_compute_blocks": 2}, r"\['fn_compute_blocks'\] \(did you mean 'Fn_compute_blocks'\?\)"),
    ({"max_warmup_step": 2, "Fn": 1}, r"\(did you mean 'max_warmup_steps' for 'max_warmup_step'\?\)"),
])
def test_bad_params_are_refused_with_the_fix(values, message):
    with pytest.raises(ValueError, match=message):
        CacheDitParams.from_mapping(values)


def test_params_that_cannot_run_on_the_model_or_the_steps_are_refused():
    with pytest.raises(ValueError, match=r"Fn_compute_blocks \(1\) \+ Bn_compute_blocks \(1\) must leave at least one "
                                         r"of the DiT's 2 fused blocks to cache; lower them to a sum of at most 1"):
        CacheDitParams(Bn_compute_blocks=1).check_against(num_blocks=2, num_steps=10)
    with pytest.raises(ValueError, match=r"scm_preset needs 4, 6 or at least 8 steps, the request has 5"):
        CacheDitParams(scm_preset="fast").steps_mask(5)
    with pytest.raises(ValueError, match=r"cover 3 steps; the request has 10"):
        CacheDitParams(scm_compute_bins=(2,), scm_cache_bins=(1,)).steps_mask(10)


def test_config_is_parsed_from_json_text_a_file_or_a_mapping(tmp_path):
    yaml_file = tmp_path / "cache.yaml"
    yaml_file.write_text("Fn_compute_blocks: 2\nscm_compute_bins: [3, 1]\nscm_cache_bins: [2]\n")
    assert parse_cache_dit_config(str(yaml_file)) == CacheDitParams(Fn_compute_blocks=2, scm_compute_bins=(3, 1),
                                                                    scm_cache_bins=(2,))
    upper = tmp_path / "CACHE.YML"  # a capitalised suffix was read as JSON and refused
    upper.write_text("Fn_compute_blocks: 2\n")
    assert parse_cache_dit_config(str(upper)) == CacheDitParams(Fn_compute_blocks=2)
    assert parse_cache_dit_config('{"residual_diff_threshold": 0.12}').residual_diff_threshold == 0.12
    assert parse_cache_dit_config("{}") == CacheDitParams()
    with pytest.raises(ValueError, match="neither a JSON object nor a readable file"):
        parse_cache_dit_config("missing.json")
    with pytest.raises(ValueError, match="is not a valid JSON object"):
        parse_cache_dit_config("{oops")
    config = build_engine_config("demo", cache_dit_config={"max_warmup_steps": 2}).runtime.cache_dit_config
    assert config == CacheDitParams(max_warmup_steps=2)


def test_a_config_files_errors_name_the_flag_and_the_file(tmp_path):
    # "Unknown cache_dit_params key(s)" named neither; a .json file that does not parse was shown an inline example.
    for name, text in (("c.json", '{"scm_presett": "fast"}'), ("c.yaml", "scm_presett: fast\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError) as raised:
            parse_cache_dit_config(str(tmp_path / name))
        assert str(raised.value).startswith(f"--cache-dit-config {str(tmp_path / name)!r}: Unknown cache_dit_params "
                                            "key(s) ['scm_presett'] (did you mean 'scm_preset'?)")
    (tmp_path / "d.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"^--cache-dit-config '.*d\.json' is not valid JSON \(Expecting property "):
        parse_cache_dit_config(str(tmp_path / "d.json"))
    (tmp_path / "l.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match=r"^--cache-dit-config '.*l\.yaml' must hold a mapping of cache_dit_params "
                                         r"keys, got list$"):
        parse_cache_dit_config(str(tmp_path / "l.yaml"))
    with pytest.raises(ValueError, match=r"^--cache-dit-config: cache_dit_params\.Fn_compute_blocks must be an "):
        parse_cache_dit_config('{"Fn_compute_blocks": -1}')


def test_a_step_count_the_engines_mask_cannot_cover_says_how_to_run_it():
    # The refusal blamed cache_dit_params (which the client had not sent) and said to drop scm_preset; what works is
    # another step count, or caching off for the request.
    engine = CacheDitParams(scm_preset="fast")
    with pytest.raises(ValueError) as raised:
        resolve_generate(SamplingParams(prompt="a", num_inference_steps=3), VARIANTS["pro"], engine_cache_dit=engine)
    assert str(raised.value) == ("num_inference_steps 3 does not fit the engine's Cache-DiT step mask "
                                 "(--cache-dit-config: its scm_preset 'fast' needs 4, 6 or at least 8 steps); use "
                                 "steps it covers, or turn caching off for this request with enable_cache_dit false.")
    bins = CacheDitParams(scm_compute_bins=(2,), scm_cache_bins=(1,))
    with pytest.raises(ValueError, match=r"\(--cache-dit-config: its scm_compute_bins and scm_cache_bins cover 3 "
                                         r"steps\)"):
        resolve_generate(SamplingParams(prompt="a", num_inference_steps=10), VARIANTS["pro"], engine_cache_dit=bins)
    request, _ = resolve_generate(SamplingParams(prompt="a", num_inference_steps=3, enable_cache_dit=False),
                                  VARIANTS["pro"], engine_cache_dit=engine)
    assert request.cache_dit is None
    # A request that sets only how masked steps are used (scm_policy) did not choose the mask: the engine's words.
    with pytest.raises(ValueError, match=r"^num_inference_steps 3 does not fit the engine's Cache-DiT step mask"):
        resolve_generate(SamplingParams(prompt="a", num_inference_steps=3, cache_dit_params={"scm_policy": "static"}),
                         VARIANTS["pro"], engine_cache_dit=engine)
    # The request's own mask keeps the field's wording.
    with pytest.raises(ValueError, match=r"^cache_dit_params\.scm_preset needs 4, 6 or at least 8 steps"):
        resolve_generate(SamplingParams(prompt="a", num_inference_steps=3, cache_dit_params={"scm_preset": "fast"}),
                         VARIANTS["pro"], engine_cache_dit=CacheDitParams())


def test_a_requests_step_mask_replaces_the_engines_whole():
    """Request keys are merged over the engine's, but a step mask is one setting: a request's bins beside the
    engine's preset (or its preset beside the engine's bins) were refused as "both define the step mask"."""
    bins = {"scm_compute_bins": [4, 2], "scm_cache_bins": [1, 2]}
    request, _ = resolve_generate(SamplingParams(prompt="a", num_inference_steps=9, cache_dit_params=bins),
                                  VARIANTS["pro"], engine_cache_dit=CacheDitParams(scm_preset="medium",
                                                                                   max_warmup_steps=2))
    assert request.cache_dit == CacheDitParams(scm_compute_bins=(4, 2), scm_cache_bins=(1, 2), max_warmup_steps=2)
    request, _ = resolve_generate(
        SamplingParams(prompt="a", num_inference_steps=8, cache_dit_params={"scm_preset": "fast"}), VARIANTS["pro"],
        engine_cache_dit=CacheDitParams(scm_compute_bins=(2,), scm_cache_bins=(1,)))
    assert request.cache_dit == CacheDitParams(scm_preset="fast")


# -- DBCache decisions on toy blocks ----------------------------------------------------------------------------


class _ToyBlock(nn.Module):
    """Adds `values[step]` to the video (and a tenth of it to the audio) and records that it ran."""

    def __init__(self, name: str, values: dict[int, float], log: list[str]) -> None:
        super().__init__()
        self.name, self.values, self.log = name, values, log

    def forward(self, *, video_BLD, audio_BAD, step):
        self.log.append(self.name)
        value = self.values[step]
        return video_BLD + value, audio_BAD + value / 10


def _drive(params: CacheDitParams, fingerprints: list[float], middle: list[float] | None = None,
           branches=(POSITIVE,), last: float = 0.0):
    """Run the session over `len(fingerprints)` steps on blocks [F (adds the fingerprint), M (adds middle[step]),
    B (adds `last`)]; returns the session, the blocks that ran per step and branch, and the outputs."""
    num_steps = len(fingerprints)
    middle = middle if middle is not None else [100.0 + s for s in range(num_steps)]
    log: list[str] = []
    blocks = nn.ModuleList([_ToyBlock("F", dict(enumerate(fingerprints)), log),
                            _ToyBlock("M", dict(enumerate(middle)), log),
                            _ToyBlock("B", dict.fromkeys(range(num_steps), last), log)])
    session = BlockCacheSession(params, num_steps=num_steps, num_blocks=3, token_sum=lambda x: x.sum(dim=1))
    ran, outputs = [], []
    for step in range(num_steps):
        session.begin_step(step)
        for branch in branches:
            session.branch = branch
            log.clear()
            video, audio = session(blocks, torch.zeros(1, 4, 2), torch.zeros(1, 3, 2), {"step": step})
            ran.append("".join(log))
            outputs.append((video[0, 0, 0].item(), audio[0, 0, 0].item()))
    return session, ran, outputs


def test_after_warmup_a_step_within_the_threshold_reuses_the_last_middle_residual():
    params = CacheDitParams(Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=2,
                            residual_diff_threshold=0.2, max_continuous_cached_steps=-1)
    # Fingerprint distances to the last computed step: step 2 0.1 (cache), 3 0.15 (cache, still against step 1),
    # 4 0.3 (compute), 5 0.0 (cache, against step 4).
    session, ran, outputs = _drive(params, [1.0, 1.0, 1.1, 1.15, 1.3, 1.3])
    assert ran == ["FMB", "FMB", "FB", "FB", "FMB", "FB"]
    state = session.branches[POSITIVE]
    assert state.cached_steps == [2, 3, 5]
    assert state.residual_diffs == pytest.approx({2: 0.1, 3: 0.15, 4: 0.3, 5: 0.0})
    assert session.describe().endswith("(positive: steps 2, 3, 5; steps count from 0; residual distances 0-0.3 "
                                       "against threshold 0.2).")
    # A cached step adds the middle block's residual of the last computed step (101 at step 2, 104 at step 5).
    assert outputs[2] == pytest.approx((1.1 + 101, 0.11 + 10.1))
    assert outputs[5] == pytest.approx((1.3 + 104, 0.13 + 10.4))
    assert outputs[4] == pytest.approx((1.3 + 104, 0.13 + 10.4))


def test_the_cached_step_limits_force_a_computed_step():
    same = [1.0] * 8
    _, ran, _ = _drive(CacheDitParams(max_warmup_steps=1, max_continuous_cached_steps=2), same)
    assert ran == ["FMB", "F", "F", "FMB", "F", "F", "FMB", "F"]
    _, ran, _ = _drive(CacheDitParams(max_warmup_steps=1, max_continuous_cached_steps=-1, max_cached_steps=3), same)
    assert ran == ["FMB", "F", "F", "F", "FMB", "FMB", "FMB", "FMB"]
    _, ran, _ = _drive(CacheDitParams(max_warmup_steps=4, warmup_interval=2, max_continuous_cached_steps=-1), same)
    assert ran == ["FMB", "F", "FMB", "F", "F", "F", "F", "F"]  # warmup is steps 0 and 2 only
    _, ran, _ = _drive(CacheDitParams(max_warmup_steps=1, residual_diff_threshold=0.0), same)
    assert ran == ["FMB"] * 8  # threshold 0: never on the distance


def test_step_masks_static_and_dynamic():
    drifting = [2.0**s for s in range(8)]  # every distance to an earlier step is >= 1
    bins = {"scm_compute_bins": (2, 1, 2), "scm_cache_bins": (2, 1), "max_warmup_steps": 8,
            "max_continuous_cached_steps": -1}
    session, ran, _ = _drive(CacheDitParams(scm_policy="static", **bins), drifting)
    # Mask 1 1 0 0 1 0 1 1: static caches every 0 step whatever the distance; warmup stops at the first 0.
    assert ran == ["FMB", "FMB", "F", "F", "FMB", "F", "FMB", "FMB"]
    assert session.warmup_steps == {0, 1} and session.branches[POSITIVE].residual_diffs == {}
    _, ran, _ = _drive(CacheDitParams(scm_policy="dynamic", **bins), drifting)
    assert ran == ["FMB"] * 8  # dynamic: a 0 step still needs a small distance
    _, ran, _ = _drive(CacheDitParams(scm_policy="dynamic", **bins), [1.0] * 8)
    assert ran == ["FMB", "FMB", "F", "F", "FMB", "F", "FMB", "FMB"]


def test_cfg_branches_keep_their_own_state():
    session, ran, _ = _drive(CacheDitParams(max_warmup_steps=1, max_continuous_cached_steps=1), [1.0] * 4,
                             branches=(POSITIVE, NEGATIVE))
    assert ran == ["FMB", "FMB", "F", "F", "FMB", "FMB", "F", "F"]
    assert session.branches[POSITIVE].cached_steps == session.branches[NEGATIVE].cached_steps == [1, 3]
    assert session.num_cached_calls == 4
    assert "on 4 of 8 calls (positive: steps 1, 3; negative: steps 1, 3" in session.describe()


def test_taylorseer_extrapolates_a_linear_residual_exactly():
    params = CacheDitParams(max_warmup_steps=4, residual_diff_threshold=1.0, max_continuous_cached_steps=-1,
                            enable_taylorseer=True, taylorseer_order=1, Bn_compute_blocks=0)
    middle = [10.0 + 3.0 * s for s in range(7)]
    _, ran, outputs = _drive(params, [1.0] * 7, middle)
    assert ran == ["FMB"] * 4 + ["F"] * 3
    for step in (4, 5, 6):  # from steps 2 and 3: the residual 10 + 3s, so 22, 25, 28
        assert outputs[step] == pytest.approx((1.0 + middle[step], 0.1 + middle[step] / 10))
    # Without TaylorSeer the last computed residual (step 3) is reused as it is.
    _, _, plain = _drive(CacheDitParams(max_warmup_steps=4, residual_diff_threshold=1.0,
                                        max_continuous_cached_steps=-1), [1.0] * 7, middle)
    assert plain[6] == pytest.approx((1.0 + middle[3], 0.1 + middle[3] / 10))


@pytest.mark.parametrize("taylorseer", [False, True])
def test_without_warmup_steps_the_first_step_is_computed(taylorseer):
    """max_warmup_steps 0: the first step has nothing to reuse. With TaylorSeer, whose state exists from the start,
    the first steps skipped the middle blocks and added a residual of 0 (or compared against no fingerprint)."""
    params = CacheDitParams(max_warmup_steps=0, residual_diff_threshold=1.0, max_continuous_cached_steps=-1,
                            enable_taylorseer=taylorseer)
    _, ran, outputs = _drive(params, [1.0] * 4)
    assert ran == ["FMB", "F", "F", "F"]
    assert outputs[0] == pytest.approx((1.0 + 100.0, 0.1 + 10.0))
    _drive(CacheDitParams(max_warmup_steps=0, enable_taylorseer=taylorseer), [1.0] * 4)  # the default threshold ran


def test_taylorseer_skips_the_derivative_before_its_third_step_as_cache_dit_does():
    seer = TaylorSeer(order=2)
    for value in (1.0, 2.0):
        seer.mark_step_begin()
        seer.update(torch.tensor(value))
    assert seer.derivatives[1] is None  # cache-dit needs current_step > 1
    seer.mark_step_begin()
    seer.update(torch.tensor(4.0))
    assert [d.item() for d in seer.derivatives[:2]] == [4.0, 2.0] and seer.derivatives[2] is None
    seer.mark_step_begin()
    seer.mark_step_begin()  # two cached steps later
    assert seer.approximate().item() == 4.0 + 2.0 * 2


# -- the real tiny DiT ----------------------------------------------------------------------------------------


def _run(worker: ModelWorker, **kwargs):
    params = SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5,
                            num_inference_steps=4, **kwargs)
    return worker.run(params, NO_FILE)


@pytest.fixture(scope="module")
def pro_worker(tiny_pro_dir):
    torch.set_num_threads(1)
    return ModelWorker(build_engine_config(str(tiny_pro_dir), device="cpu", attention_backend="sdpa"))


def test_all_steps_computed_is_bitwise_the_uncached_request_and_caching_changes_it(pro_worker):
    baseline = _run(pro_worker)
    warm = _run(pro_worker, cache_dit_params={"max_warmup_steps": 4})
    assert np.array_equal(warm.frames, baseline.frames) and np.array_equal(warm.audio, baseline.audio)
    assert warm.timings["cache_dit_cached_calls"] == 0 and "cache_dit_cached_calls" not in baseline.timings
    cached = _run(pro_worker, enable_cache_dit=True,
                  cache_dit_params={"max_warmup_steps": 1, "residual_diff_threshold": 1.0})
    assert cached.timings["cache_dit_cached_calls"] == 6  # steps 1-3 of both CFG branches
    assert "skipped the middle 1 of 2 DiT blocks on 6 of 8 calls (positive: steps 1, 2, 3; negative: steps 1, 2, 3"\
        in cached.notes[-1]
    assert not np.array_equal(cached.frames, baseline.frames) and not np.array_equal(cached.audio, baseline.audio)
    again = _run(pro_worker, cache_dit_params={"max_warmup_steps": 1, "residual_diff_threshold": 1.0})
    assert np.array_equal(again.frames, cached.frames) and np.array_equal(again.audio, cached.audio)
    after = _run(pro_worker)
    assert np.array_equal(after.frames, baseline.frames) and np.array_equal(after.audio, baseline.audio)
    assert pro_worker.pipeline.models.transformer.fused_blocks.runner is None


def test_a_failed_request_leaves_the_dit_uncached(pro_worker, monkeypatch):
    block = pro_worker.pipeline.models.transformer.visual_transformer_blocks[1]
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(block, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        _run(pro_worker, enable_cache_dit=True)
    assert calls and pro_worker.pipeline.models.transformer.fused_blocks.runner is None
    monkeypatch.undo()
    transformer = pro_worker.pipeline.models.transformer
    with block_cache(transformer, CacheDitParams(), num_steps=4):
        with pytest.raises(RuntimeError, match="one cached request at a time"):
            with block_cache(transformer, CacheDitParams(), num_steps=4):
                pass
    assert transformer.fused_blocks.runner is None


def test_engine_default_request_switches_and_refusals(tiny_distill_dir, tiny_sr_dir):
    variant = VARIANTS["pro-distill"]
    engine = CacheDitParams(residual_diff_threshold=0.1)

    def resolve(**kwargs):
        return resolve_generate(SamplingParams(prompt="x", **kwargs), variant, engine_cache_dit=engine)[0].cache_dit

    assert resolve() == engine
    assert resolve(enable_cache_dit=False) is None
    assert resolve(cache_dit_params={"Fn_compute_blocks": 2}) == CacheDitParams(residual_diff_threshold=0.1,
                                                                                 Fn_compute_blocks=2)
    plain, notes = resolve_generate(SamplingParams(prompt="x", cache_dit_params={}), variant)
    assert plain.cache_dit == CacheDitParams()
    assert "Cache-DiT on pro-distill, a 10-step distilled checkpoint" in notes[-1]
    assert not resolve_generate(SamplingParams(prompt="x", cache_dit_params={}), VARIANTS["pro"])[1]
    assert resolve_generate(SamplingParams(prompt="x"), variant)[0].cache_dit is None
    with pytest.raises(ValueError, match="cache_dit_params was given with enable_cache_dit false"):
        resolve(enable_cache_dit=False, cache_dit_params={})
    with pytest.raises(ValueError, match="scm_preset needs 4, 6 or at least 8 steps, the request has 5"):
        resolve(num_inference_steps=5, cache_dit_params={"scm_preset": "fast"})
    with pytest.raises(ValueError, match="Cache-DiT is not available on this engine: because"):
        resolve_generate(SamplingParams(prompt="x", enable_cache_dit=True), variant, cache_dit_unavailable="because")
    with pytest.raises(ValueError, match="the super-resolution model runs 2 DiT steps per tile"):
        resolve_upscale(SamplingParams(video_path="a.mp4", enable_cache_dit=True), VARIANTS["vsr"])
    with pytest.raises(ValueError, match=r"--cache-dit-config cannot be used with --use-fsdp-inference with "
                                         r"--enable-cfg-parallel"):
        build_engine_config("demo", cache_dit_config={}, num_gpus=2, enable_cfg_parallel=True,
                            use_fsdp_inference=True)
    with pytest.raises(ValueError, match="--cache-dit-config applies to the generation models"):
        ModelWorker(build_engine_config(str(tiny_sr_dir), device="cpu", cache_dit_config={}))
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa",
                                             cache_dit_config={"Bn_compute_blocks": 1}))
    with pytest.raises(ValueError, match=r"must leave at least one of the DiT's 2 fused blocks"):
        _run(worker)


@pytest.mark.parametrize(("prefetch_blocks", "resident_blocks"), [(1, 0), (2, 0), (2, 3)])
def test_memory_mode_block_streaming_gives_the_resident_cached_result(tiny_distill_dir, prefetch_blocks,
                                                                      resident_blocks):
    """Our block streamer follows the order blocks actually run in, so skipped blocks cost a missed prefetch, not a
    wrong result (the reference refuses Cache-DiT with layerwise offload); also with a deeper prefetch and with
    resident blocks (test_offload.py checks the streamer's memory bound when cached steps skip blocks)."""
    from k6serve.offload import apply_offload
    from k6serve.speed.performance_mode import transformer_plan

    torch.set_num_threads(1)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", performance_mode="memory",
                                             attention_backend="sdpa"))
    settings = {"cache_dit_params": {"max_warmup_steps": 1, "residual_diff_threshold": 1.0}}
    resident = _run(worker, **settings)
    apply_offload(worker.pipeline, "memory", compute_device="cpu", prefetch_blocks=prefetch_blocks,
                  resident_blocks=resident_blocks, plan=transformer_plan(worker.pipeline.models.transformer))
    streamed = _run(worker, **settings)
    assert streamed.timings["cache_dit_cached_calls"] == 3
    assert np.array_equal(streamed.frames, resident.frames) and np.array_equal(streamed.audio, resident.audio)


def test_cli_flags_reach_the_request_and_the_engine():
    from k6serve.cli.config_file import merged_options
    from k6serve.cli.flags import build_parser, split_options

    parser = build_parser()
    args = parser.parse_args(["generate", "--model-path", "demo", "--prompt", "x", "--cache-dit-config",
                              '{"max_warmup_steps": 3}', "--cache-dit-params", '{"scm_preset": "fast"}',
                              "--enable-cache-dit"])
    engine, request = split_options(merged_options(args, parser))
    assert build_engine_config(engine.pop("model_path"), **engine).runtime.cache_dit_config == CacheDitParams(
        max_warmup_steps=3)
    assert request["cache_dit_params"] == {"scm_preset": "fast"} and request["enable_cache_dit"] is True
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--model-path", "demo", "--cache-dit-params", "[1]"])


def test_http_body_takes_the_switch_and_the_params_as_json_or_form_text():
    from k6serve.serve.errors import ApiError
    from k6serve.serve.video_create_body import parse_create_body

    body = parse_create_body({"prompt": "x", "enable_cache_dit": True, "cache_dit_params": {"Bn_compute_blocks": 0}})
    assert body.enable_cache_dit is True and body.cache_dit_params == {"Bn_compute_blocks": 0}
    form = parse_create_body({"prompt": "x", "cache_dit_params": '{"scm_policy": "static"}'})
    assert form.cache_dit_params == {"scm_policy": "static"}
    with pytest.raises(ApiError, match="cache_dit_params must be a JSON object"):
        parse_create_body({"prompt": "x", "cache_dit_params": "{oops"})
    with pytest.raises(ApiError, match="seed must be an integer, got true"):
        parse_create_body({"prompt": "x", "seed": True})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream, events and pinned copies need CUDA")
def test_cuda_memory_mode_streaming_with_skipped_blocks_matches_resident(tiny_distill_dir, monkeypatch):
    """On a GPU: the block streamer's prefetches run on a side stream, and a cached step leaves a prefetch of a
    skipped block behind; the cached request must still equal the resident cached one bit for bit, and leave no
    weight on the GPU."""
    config = build_engine_config(str(tiny_distill_dir), device="cuda", performance_mode="memory",
                                 attention_backend="sdpa")
    settings = {"cache_dit_params": {"max_warmup_steps": 1, "residual_diff_threshold": 1.0,
                                     "max_continuous_cached_steps": 2}}
    streamed_worker = ModelWorker(config)
    streamed = _run(streamed_worker, **settings)
    assert streamed.timings["cache_dit_cached_calls"] == 2  # steps 1 and 2; step 3 computes (the limit)
    for module in streamed_worker.pipeline.components().values():
        assert all(p.device.type == "cpu" for p in module.parameters())
    monkeypatch.setattr(ModelWorker, "offloads", property(lambda self: False))
    resident = _run(ModelWorker(config), **settings)
    assert np.array_equal(streamed.frames, resident.frames) and np.array_equal(streamed.audio, resident.audio)


def test_cache_dit_skips_blocks_of_a_quantized_dit(tiny_distill_dir):
    """--quantization fp8 with Cache-DiT (docs/cli.md says they work together): the quantized DiT caches the same
    calls, and a cached request differs from the quantized uncached one."""
    torch.set_num_threads(1)
    worker = ModelWorker(build_engine_config(str(tiny_distill_dir), device="cpu", attention_backend="sdpa",
                                             quantization="fp8"))
    assert worker.performance_report.num_quantized_linears > 0
    baseline = _run(worker)
    cached = _run(worker, enable_cache_dit=True, cache_dit_params={"max_warmup_steps": 1,
                                                                   "residual_diff_threshold": 1.0})
    assert cached.timings["cache_dit_cached_calls"] == 3  # steps 1-3 of 4, no CFG
    assert not np.array_equal(cached.frames, baseline.frames)
    assert np.array_equal(_run(worker).frames, baseline.frames)  # uncached again: the same quantized output


def test_a_warm_up_runs_a_request_whose_step_mask_preset_needs_more_steps_than_it(tiny_pro_dir, monkeypatch):
    # scm_preset needs 4, 6 or at least 8 steps, and a warm-up runs 2 (then 1 for another prompt length): it warms
    # the same blocks without the mask, instead of refusing a valid 8-step request (request mode) or the start-up
    # (server mode with --cache-dit-config).
    torch.set_num_threads(1)
    preset = {"scm_preset": "fast"}
    worker = ModelWorker(build_engine_config(str(tiny_pro_dir), device="cpu", warmup_mode="request"))
    result = worker.run(SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5,
                                       num_inference_steps=8, enable_cache_dit=True, cache_dit_params=preset),
                        NO_FILE)
    assert result.timings["warmup"] > 0 and result.timings["cache_dit_cached_calls"] >= 0
    monkeypatch.setattr(ModelWorker, "variant_warmup_params", lambda self: SamplingParams(
        prompt="warm-up", height=32, width=48, num_frames=5))
    worker = ModelWorker(build_engine_config(str(tiny_pro_dir), device="cpu", warmup_mode="server",
                                             cache_dit_config=preset))
    assert [report.num_inference_steps for report in worker.server_warmups] == [2]


def test_a_warm_up_runs_a_request_whose_step_mask_bins_cover_other_steps(tiny_pro_dir, monkeypatch):
    """--cache-dit-config bins cover their own step count (here 9): the server warm-up's request was resolved at
    the variant's default steps (50 for Pro) and refused after the load, with a client's wording; a request-mode
    warm-up of a request whose bins cover its 9 steps ran 2 of them against the bins."""
    torch.set_num_threads(1)
    bins = {"scm_compute_bins": [4, 2], "scm_cache_bins": [1, 2]}
    monkeypatch.setattr(ModelWorker, "variant_warmup_params", lambda self: SamplingParams(
        prompt="warm-up", height=32, width=48, num_frames=5))
    worker = ModelWorker(build_engine_config(str(tiny_pro_dir), device="cpu", warmup_mode="server",
                                             cache_dit_config=bins))
    assert [report.num_inference_steps for report in worker.server_warmups] == [2]
    worker = ModelWorker(build_engine_config(str(tiny_pro_dir), device="cpu", warmup_mode="request"))
    result = worker.run(SamplingParams(prompt="a fox in the snow", seed=7, height=32, width=48, num_frames=5,
                                       num_inference_steps=9, cache_dit_params=bins), NO_FILE)
    assert result.timings["warmup"] > 0 and "cache_dit_cached_calls" in result.timings
