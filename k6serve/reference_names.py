"""The reference server's (SGLang diffusion's) option names that k6serve does not take under that name.

Users arriving from the reference's docs type its flags, keywords and JSON fields. Each name here has either an
alias (a k6serve option of exactly the same meaning and values: accepted by the CLI and --config files) or a fix
(one sentence: what k6serve does instead, with the option to use, or why the name does not apply to Kandinsky 6).
Names are keyed by their underscore form; each surface spells them its own way (`--enable-torch-compile` on the
command line and in --config files, `enable_torch_compile` as a Python keyword or an HTTP field). SGLang's flags
of a whole config section (`--dit-config.<field>`, `--component-paths.<component>`) share their section's entry.

Fixes are written in command-line words. The Python API reads them with its keywords instead (`flags_as_keywords`
for engine options, and the request flags as parameter names); the HTTP API and `k6serve serve` with request fields,
an engine option staying a flag of `k6serve serve`. Where a fix has no such reading (a flag of the command line
only), the entry carries the API's and the server's own sentence.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from k6serve.config import flag_name
from k6serve.request import SamplingParams, did_you_mean, parameter_fields

ENGINE, REQUEST = "engine", "request"
# Where a name was typed: `k6serve generate` (or its --config file), `k6serve serve` (or its --config file), the
# Python API, or the HTTP API's request body.
SURFACES = ("cli", "serve", "api", "http")


@dataclass(frozen=True, slots=True)
class ReferenceName:
    """One reference name: an engine option or a request parameter, with its k6serve alias or its fix."""

    kind: str  # ENGINE or REQUEST
    alias: str | None = None  # the k6serve option of the same meaning and values
    fix: str | None = None  # in command-line words
    api_fix: str | None = None  # for the Python API and the HTTP API, where the command-line words do not apply
    http_fix: str | None = None  # for the HTTP API and `k6serve serve`, where neither of the above applies


def _engine(fix: str, *, api_fix: str | None = None, http_fix: str | None = None) -> ReferenceName:
    return ReferenceName(ENGINE, fix=fix, api_fix=api_fix, http_fix=http_fix)


def _request(fix: str, *, api_fix: str | None = None, http_fix: str | None = None) -> ReferenceName:
    return ReferenceName(REQUEST, fix=fix, api_fix=api_fix, http_fix=http_fix)


_COMPILE = ("k6serve compiles the DiT's repeated blocks on CUDA under --performance-mode speed, the default; "
            "--compile-vae true compiles the VAE decoder too")
_PREFETCH = ("k6serve's --offload-prefetch-blocks takes a count of blocks copied ahead of the running one, default 1, "
             "e.g. --offload-prefetch-blocks 2, for every streamed component; no fraction, no per component value")
_RESIDENT_LAYERS = ("k6serve's --offload-resident-blocks keeps that many of the DiT's streamed blocks on the GPU, "
                    "spread evenly, e.g. --offload-resident-blocks 8; the text encoders' blocks always stream")
_RESIDENCY_POLICY = ("k6serve always spreads --offload-resident-blocks evenly over the DiT's blocks, SGLang's "
                     "strided policy; there is no leading policy")
_RETIRED_WARMUP = ("retired in SGLang too; k6serve warms up with --warmup-mode server (at start) or --warmup-mode "
                   "request (before each shape's first request), off by default")
_CUDA_GRAPHS = ("k6serve captures no CUDA graphs of the DiT, and Kandinsky 6 is not on SGLang's list for them either, "
                "as its text length varies; --performance-mode speed, the default, compiles the DiT's blocks instead")
_PRECISION = ("k6serve has one --dtype for every component: auto, the default, is bfloat16 on CUDA and float32 on "
              "the CPU")
_ATTENTION = ("k6serve takes one --attention-backend, for the DiT, and the text encoders keep their own attention; "
              "there are no per component backends or backend settings")
_NO_WEB_UI = "k6serve has no web UI; clients use the HTTP API of `k6serve serve`, docs/http-api.md"
_BATCHING = ("k6serve runs one request per replica at a time, in arrival order; run several at once with "
             "--dp-size 2 and --num-gpus 2")
_REQUEST_LOGS = ("uvicorn's access log lists each HTTP request, GET /v1/videos/{id} a job's state and inference "
                 "time, and GET /metrics the Prometheus counters and latency histograms")
_TRACES = ("k6serve exports no traces; GET /metrics of `k6serve serve` serves Prometheus counters and latency "
           "histograms")
_SEQUENCE_PARALLEL = ("k6serve's sequence parallelism is --ulysses-degree and --ring-degree, whose product is "
                      "SGLang's --sp-degree, e.g. --ulysses-degree 4")
_HSDP = ("k6serve shards the DiT's weights with FSDP across a whole replica with --use-fsdp-inference true, and "
         "replicas are --dp-size")
_SIZE = ("k6serve takes the size as --height and --width in pixels, multiples of 16 up to 2048, default height "
         "512, width 768, e.g. --height 720 --width 1280; super-resolution's output size is --sr-target-resolution, "
         "e.g. fullhd")
_SIZE_API = ("k6serve takes the size as height and width in pixels, multiples of 16 up to 2048, default height "
             "512, width 768, e.g. height=720, width=1280; super-resolution's output size is sr_target_resolution, "
             "e.g. 'fullhd'")
_SIZE_HTTP = ("k6serve takes the size as height and width in pixels, multiples of 16 up to 2048, default height "
              "512, width 768, or as size, width first, e.g. \"1280x720\"; super-resolution's output size is "
              "sr_target_resolution, e.g. \"fullhd\"")
_FRAMES = ("k6serve takes --num-frames of the form 4k+1 up to 509 and turns another count n into n // 4 * 4 + 1 "
           "with a note, e.g. 120 -> 121, 123 -> 121, never rounding it to the number of GPUs")
_PROFILE = ("`k6serve generate` prints each stage's seconds after the run, e.g. encode, denoise per step and decode; "
            "`k6serve bench` times the stages against diffusers")
_PROFILE_API = ("the result's timings hold each stage's seconds, e.g. encode, denoise_per_step and decode_video; "
                "`k6serve bench` times the stages against diffusers")
_PROFILE_HTTP = ("a finished job reports its inference_time_s, GET /metrics the step and job latencies, and "
                 "`k6serve bench` times the stages against diffusers")
_PROFILING = _request(_PROFILE, api_fix=_PROFILE_API, http_fix=_PROFILE_HTTP)
_TRAJECTORY = "k6serve returns the finished video only, not the latents or frames of the intermediate steps"
_ONE_VIDEO = _request(
    "k6serve makes one video per request: run again with another --seed; --prompt-file-path runs several "
    "prompts on one model load",
    api_fix="k6serve makes one video per request: call generate() again with another seed",
    http_fix="k6serve makes one video per job: send another request with another seed")
_ONE_GUIDANCE = ("Kandinsky 6 has one guidance scale, --guidance-scale, for Pro and Lite; the distilled models run "
                 "without guidance")
_ENCODING = ("k6serve writes H.264 with x264's crf 18 and medium preset, and AAC audio; there is no quality setting: "
             "drop it")
_URLS = ("k6serve fetches no URLs: download the file and pass it as --image-path, or --video-path for "
         "super-resolution")
_URLS_HTTP = ("k6serve fetches no URLs: upload the file as input_reference in a multipart request, or name a file "
              "on the server, in a folder it allows with --allowed-input-dir, as image_path or video_path")
_URL_FIELD = _request(_URLS, http_fix=_URLS_HTTP)  # the API's words: the flags as parameter names
_EXTRA = _request("put the parameters in the request itself",
                  http_fix="put its fields in the body itself, as the OpenAI SDK's extra_body does")
_NO_IMAGE_ENCODER = "Kandinsky 6 has no image encoder, as the video VAE encodes a TI2AV image: drop it"
_PIPELINE = ("k6serve picks the pipeline by the model's name or its model_index.json, and --model-id names the model "
             "of a renamed folder, e.g. --model-id Kandinsky-6.0-Pro-distill-5s-Diffusers")
_PIPELINE_CONFIG = _engine("k6serve has no pipeline config: its settings are flags, e.g. --vae-tiling on, which a "
                           "--config FILE can hold too",
                           api_fix="k6serve has no pipeline config: its settings are keywords of from_pretrained(), "
                                   "e.g. vae_tiling='on'")
# The checkpoints' component keys (model_index.json), for SGLang's `--<component>-path`.
_CHECKPOINT_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                          "scheduler", "audio_vae", "vocoder", "latent_upscaler")
_COMPONENT_PATHS = ("k6serve loads every component from the --model-path folder: to swap one, copy the folder, "
                    "replace that component's subfolder, e.g. vae, and pass the copy as --model-path")
_WHOLE_VAE = ("k6serve loads the video VAE whole, as it decodes every video and encodes a TI2AV image or a "
              "super-resolution source: drop it")
_SPATIAL_TILES = ("k6serve's spatial VAE tiles, with --vae-tiling on, are 256 pixels with a stride of 192, SGLang's "
                  "defaults too; there is no tile size to set")
_TEMPORAL_TILES = ("k6serve's generation VAE decodes in temporal tiles of 16 frames with a stride of 12, blended over "
                   "4, SGLang's defaults too; there is no switch or size to set")
_NVTX = "k6serve adds no NVTX ranges; "
_OTHER_RESOLUTION = "a pipeline resolution is a setting of other models, not of Kandinsky 6; "
_INTERPOLATION = ("k6serve adds no interpolated frames: the video holds the --num-frames frames the model makes, "
                  "played at --fps")
_SR_CHECKPOINT = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
_UPSCALING = _request(
    "k6serve upscales with the Kandinsky 6 super-resolution model, loaded on its own: run `k6serve generate` of "
    f"{_SR_CHECKPOINT} with the finished video as --video-path and --sr-resolution-scale 2, 4 or 2.25",
    api_fix="k6serve upscales with the Kandinsky 6 super-resolution model, loaded on its own: pass the finished "
            f"video to upscale() of a DiffGenerator of {_SR_CHECKPOINT}, with sr_resolution_scale=2, 4 or 2.25",
    http_fix="k6serve upscales with the Kandinsky 6 super-resolution model, loaded on its own: upload the finished "
             f"video as video_reference to a `k6serve serve` of {_SR_CHECKPOINT}, with sr_resolution_scale 2, 4 or "
             "2.25")

REFERENCE_NAMES: dict[str, ReferenceName] = {
    # Engine options: pure renames, accepted on the command line and in --config files.
    "mode": ReferenceName(ENGINE, alias="performance_mode"),
    "dp": ReferenceName(ENGINE, alias="dp_size"),
    "data_parallel_size": ReferenceName(ENGINE, alias="dp_size"),
    "layerwise_offload_modules": ReferenceName(ENGINE, alias="layerwise_offload_components"),
    # Compile and CUDA graphs.
    "enable_torch_compile": _engine(_COMPILE),
    "regional_compile": _engine(_COMPILE),
    "enable_breakable_cuda_graph": _engine(_CUDA_GRAPHS),
    "bcg_text_buckets": _engine(_CUDA_GRAPHS),
    "warmup_steps": _engine("k6serve's warm-up, with --warmup-mode request or --warmup-mode server, runs at most 2 "
                            "denoising steps of each shape it warms; there is no step count to set"),
    # SGLang's retired keys, which its own --config refuses; an old config file still holds them.
    "warmup": _engine(_RETIRED_WARMUP),
    "server_warmup": _engine(_RETIRED_WARMUP),
    "decoder_tp": _engine("retired in SGLang too; k6serve does not split the generation VAE's decode across GPUs, and "
                          "--vae-tiling on lowers its peak; the super-resolution VAE's tiles are decoded across GPUs "
                          "by default, --vae-config.use-parallel-tiling"),
    "offload_during_compile": _engine("k6serve never compiles streamed blocks, which run eager, and runs no "
                                      "max-autotune warm-up, so there is nothing to switch during a compile: drop "
                                      "it"),
    # Offload and residency.
    "dit_cpu_offload": _engine("offload the DiT with --cpu-offload-components transformer, or keep it on the GPU, "
                               "SGLang's false, with --component-residency transformer=resident"),
    "text_encoder_cpu_offload": _engine("offload the text encoders with --cpu-offload-components text_encoders, or "
                                        "keep them on the GPU, SGLang's false, with --component-residency "
                                        "text_encoders=resident"),
    "vae_cpu_offload": _engine("offload the VAE with --cpu-offload-components vae, or keep it on the GPU, SGLang's "
                               "false, with --component-residency vae=resident; the group audio names the audio VAE "
                               "and the vocoder"),
    "image_encoder_cpu_offload": _engine(_NO_IMAGE_ENCODER),
    "dit_layerwise_offload": _engine("stream the DiT's blocks with --layerwise-offload-components transformer, or "
                                     "the DiT's and the text encoders' with --performance-mode memory"),
    "dit_offload_prefetch_size": _engine(_PREFETCH),
    "layerwise_prefetch_size": _engine(_PREFETCH),
    "dit_layerwise_resident_layers": _engine(_RESIDENT_LAYERS),
    "layerwise_resident_layers": _engine(_RESIDENT_LAYERS),
    "dit_layerwise_residency_policy": _engine(_RESIDENCY_POLICY),
    "layerwise_residency_policy": _engine(_RESIDENCY_POLICY),
    "pin_cpu_memory": _engine("k6serve always page-locks the host copies of offloaded weights on CUDA; there is no "
                              "switch"),
    # Parallelism and devices.
    "sp_degree": _engine(_SEQUENCE_PARALLEL),
    "kv_gather_degree": _engine(_SEQUENCE_PARALLEL),
    "sp_split_auto": _engine(_SEQUENCE_PARALLEL),
    "cfg_parallel_size": _engine("k6serve runs Kandinsky 6's two guidance branches on two GPUs with "
                                 "--enable-cfg-parallel (always 2 branches)"),
    "hsdp_replicate_dim": _engine(_HSDP),
    "hsdp_shard_dim": _engine(_HSDP),
    "gpu_ids": _engine("k6serve uses the first --num-gpus visible GPUs: pick them with CUDA_VISIBLE_DEVICES, e.g. "
                       "CUDA_VISIBLE_DEVICES=2,3 with --num-gpus 2"),
    "base_gpu_id": _engine("k6serve uses the first --num-gpus visible GPUs: pick them with CUDA_VISIBLE_DEVICES, "
                           "e.g. CUDA_VISIBLE_DEVICES=2,3 with --num-gpus 2"),
    "dist_timeout": _engine("k6serve's timeout of collectives and of the ranks' joining is the Python API's "
                            "dist_timeout_s, in seconds, default 600 (a model's download, load and warm-up are "
                            "waited for as long as the ranks live, if a replica's ranks finish within it of each "
                            "other); the command line keeps the default",
                            api_fix="k6serve calls it dist_timeout_s, in seconds, default 600"),
    "master_port": _engine("k6serve's ranks on one host meet on a port the OS picks; several hosts use "
                           "--dist-init-addr HOST:PORT",
                           api_fix="k6serve's ranks on one host meet on a port the OS picks; several hosts use "
                                   "dist_init_addr='HOST:PORT'"),
    "enable_nccl_nvls": _engine("k6serve sets none of NCCL's options: NVLS follows NCCL's own environment variable, "
                                "e.g. NCCL_NVLS_ENABLE=0"),
    # Precision, backends, loading.
    "dit_precision": _engine(_PRECISION),
    "vae_precision": _engine(_PRECISION),
    "text_encoder_precisions": _engine(_PRECISION),
    "image_encoder_precision": _engine(_NO_IMAGE_ENCODER),
    "disable_autocast": _engine("k6serve runs no autocast, so there is none to turn off: the weights are cast once "
                                "to --dtype, as diffusers' torch_dtype does"),
    "kv_cache_quant": _engine("k6serve keeps no KV cache to quantize, as Kandinsky 6 is not a causal model; "
                              "--quantization fp8 quantizes the DiT's video-token linears"),
    "backend": _engine("k6serve is its own native implementation of Kandinsky 6, with no diffusers fallback: drop "
                       "it"),
    "trust_remote_code": _engine("k6serve runs no code from the checkpoint, as it builds Kandinsky 6 with its own "
                                 "classes and those of diffusers and transformers: drop it"),
    "attention_backend_config": _engine(_ATTENTION),
    "component_attention_backends": _engine(_ATTENTION),
    "model_subfolder": _engine("k6serve reads model_index.json at the top of --model-path: download the repository "
                               "and pass the subfolder that holds it, e.g. --model-path ./repo/subfolder",
                               api_fix="k6serve reads model_index.json at the top of model_path: download the "
                                       "repository and pass the subfolder that holds it, e.g. "
                                       "model_path='./repo/subfolder'"),
    "model_variant": _engine("each Kandinsky 6 variant is a checkpoint of its own: pass its hub id or folder as "
                             "--model-path, e.g. kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers"),
    "pipeline": _engine(_PIPELINE),
    "pipeline_class_name": _engine(_PIPELINE),
    "pipeline_config": _PIPELINE_CONFIG,
    "pipeline_config_path": _PIPELINE_CONFIG,
    "dit_config": _engine("k6serve builds the DiT as the checkpoint's transformer/config.json says, with nothing to "
                          "override: drop it"),
    "component_paths": _engine(_COMPONENT_PATHS),
    **{f"{component}_path": _engine(_COMPONENT_PATHS) for component in _CHECKPOINT_COMPONENTS},
    "transformer_weights_path": _engine("k6serve loads the DiT from the checkpoint's transformer folder only, with "
                                        "no pre-quantized or GGUF weights; --quantization fp8 quantizes its "
                                        "video-token linears at load"),
    "direct_gpu_weight_loading": _engine("k6serve reads the DiT's weights into host memory and then moves them to "
                                         "the GPU; there is no direct load to choose: drop it"),
    "load_diffusion_decoder": _engine("Kandinsky 6 has no diffusion decoder, an LTX-2.5 component, as its VAEs and "
                                      "vocoder decode the video and the audio: drop it"),
    # The VAE.
    "vae_slicing": _engine("k6serve decodes one video per request, so there is no batch to slice; --vae-tiling on "
                           "lowers the decode's peak memory"),
    "vae_sp": _engine("k6serve does not split the generation VAE's decode across GPUs, and --vae-tiling on lowers "
                      "its peak; the super-resolution VAE's tiles are decoded across GPUs by default, "
                      "--vae-config.use-parallel-tiling"),
    "vae_config.use_tiling": _engine("k6serve's switch is --vae-tiling on or --vae-tiling off; auto, the default, is "
                                     "on with --performance-mode memory on a GPU"),
    "vae_config.load_encoder": _engine(_WHOLE_VAE),
    "vae_config.load_decoder": _engine(_WHOLE_VAE),
    "vae_config.tile_sample_min_height": _engine(_SPATIAL_TILES),
    "vae_config.tile_sample_min_width": _engine(_SPATIAL_TILES),
    "vae_config.tile_sample_stride_height": _engine(_SPATIAL_TILES),
    "vae_config.tile_sample_stride_width": _engine(_SPATIAL_TILES),
    "vae_config.tile_sample_min_num_frames": _engine(_TEMPORAL_TILES),
    "vae_config.tile_sample_stride_num_frames": _engine(_TEMPORAL_TILES),
    "vae_config.blend_num_frames": _engine(_TEMPORAL_TILES),
    "vae_config.use_temporal_tiling": _engine(_TEMPORAL_TILES),
    # The pipeline's settings of other models.
    "resolution": _engine(_OTHER_RESOLUTION + _SIZE, api_fix=_OTHER_RESOLUTION + _SIZE_API,
                          http_fix=_OTHER_RESOLUTION + _SIZE_HTTP),
    "embedded_cfg_scale": _engine("Kandinsky 6 has no embedded guidance, a feature of guidance-distilled models "
                                  "such as FLUX: Pro and Lite take --guidance-scale, and the distilled models run "
                                  "without guidance"),
    "dmd_denoising_steps": _engine("Kandinsky 6's distilled generation models are PiFlow, not DMD: the "
                                   "checkpoint's scheduler spaces the timesteps for --num-inference-steps, default "
                                   "10; there is no list of steps to set"),
    # LoRA.
    "lora_weight_name": _engine("pass the .safetensors file itself as --lora-path; a folder is read for "
                                "pytorch_lora_weights.safetensors, else its only .safetensors file"),
    "lora_target_modules": _engine("an adapter applies to the DiT modules its file names, and one the DiT lacks is "
                                   "refused; to leave modules out, remove their keys from the file"),
    # The server.
    "strict_ports": _engine("k6serve never picks another port: a --port in use is refused at start",
                            api_fix="the Python API opens no port, and `k6serve serve` never picks another one"),
    "webui": _engine(_NO_WEB_UI),
    "webui_port": _engine(_NO_WEB_UI),
    "scheduler_port": _engine("k6serve's request queue runs in the server process, with no scheduler socket to "
                              "place: drop it"),
    "batching_mode": _engine(_BATCHING),
    "batching_max_size": _engine(_BATCHING),
    "batching_delay_ms": _engine(_BATCHING),
    "batching_config": _engine(_BATCHING),
    "enable_batching_metrics": _engine("k6serve runs one request per replica at a time, so there are no batches to "
                                       "measure; GET /metrics of `k6serve serve` serves the queue depth, the running "
                                       "jobs and their latencies"),
    "scheduler_rpc_timeout": _engine("k6serve puts no time limit on a request: DELETE /v1/videos/{id} cancels a job "
                                     "of `k6serve serve`, and Ctrl-C a `k6serve generate` run, at its next step",
                                     api_fix="k6serve puts no time limit on a request: Ctrl-C cancels the request "
                                             "that generate() waits for, at its next step"),
    "input_save_path": _engine("k6serve keeps uploads in the uploads folder of --output-path and deletes each when "
                               "its job finishes",
                               api_fix="the Python API takes no uploads; `k6serve serve` keeps them in the uploads "
                                       "folder of its output folder and deletes each when its job finishes"),
    "log_requests": _engine(_REQUEST_LOGS),
    "log_requests_level": _engine(_REQUEST_LOGS),
    "log_requests_format": _engine(_REQUEST_LOGS),
    "log_requests_target": _engine(_REQUEST_LOGS),
    "uvicorn_access_log_exclude_prefixes": _engine("k6serve's uvicorn access log leaves out the probes (GET and HEAD "
                                                   "of /health and /metrics that succeed) and lists every other "
                                                   "request, with no other prefix to leave out: --log-level warning "
                                                   "turns it off (failed jobs stay), or filter it where it is read"),
    "enable_cache_report": _engine("k6serve caches no prompt tokens, so a job has no cached tokens to report: drop "
                                   "it"),
    "enable_layerwise_nvtx_marker": _engine(_NVTX + _PROFILE, api_fix=_NVTX + _PROFILE_API,
                                            http_fix=_NVTX + _PROFILE_HTTP),
    "enable_trace": _engine(_TRACES),
    "otlp_traces_endpoint": _engine(_TRACES),
    "srt_encoder_url": _engine("k6serve runs the text encoders in the same replica as the DiT, with no remote "
                               "encoder: drop it"),
    "pe_server_url": _engine("k6serve's prompt enhancement runs in the replica, with the checkpoint's own "
                             "Qwen2.5-VL as diffusers' expand_prompts runs it, with no server: --expand-prompts for "
                             "a request"),
    "comfyui_mode": _engine("k6serve's ComfyUI nodes, integrations/comfyui and docs/comfyui.md, call a plain "
                            "`k6serve serve`; there is no mode to set"),
    "disagg_role": _engine("k6serve runs every stage of Kandinsky 6 in one replica, as SGLang serves it too: drop "
                           "it"),
    # Request parameters.
    "prompt_path": _request("k6serve reads prompts from a file, one per line, with --prompt-file-path FILE, or "
                            "takes one with --prompt",
                            api_fix="k6serve takes the text itself as prompt, or a list of prompts, one request "
                                    "each (a file's lines: prompt=[line for line in "
                                    "Path(FILE).read_text().splitlines() if line.strip()])"),
    "generator_device": _request("k6serve chooses where the noise is drawn: the generation models use a CPU "
                                 "generator, so a seed gives the same initial noise on every device, and "
                                 "super-resolution draws on the device it runs on: drop it"),
    "4k": _request(_SIZE, api_fix=_SIZE_API, http_fix=_SIZE_HTTP),
    "2k": _request(_SIZE, api_fix=_SIZE_API, http_fix=_SIZE_HTTP),
    "1080p": _request(_SIZE, api_fix=_SIZE_API, http_fix=_SIZE_HTTP),
    "720p": _request(_SIZE, api_fix=_SIZE_API, http_fix=_SIZE_HTTP),
    "guidance_rescale": _request("Kandinsky 6 uses plain classifier-free guidance without rescale: --guidance-scale "
                                 "sets its strength, and the distilled models run without guidance"),
    "boundary_ratio": _request("Kandinsky 6 runs one DiT for every step, so there is no expert boundary to set: "
                               "drop it"),
    "num_outputs_per_prompt": _ONE_VIDEO,
    "n": _ONE_VIDEO,
    "guidance_scale_2": _request(_ONE_GUIDANCE),
    "true_cfg_scale": _request(_ONE_GUIDANCE),
    "flow_shift": _request("the sampler's shift is the checkpoint's own, from scheduler/scheduler_config.json; "
                           "there is none to set per request"),
    "output_quality": _request(_ENCODING),
    "output_compression": _request(_ENCODING),
    "diffusers_kwargs": _request("k6serve runs its own pipeline, not diffusers', so there are no arguments to pass "
                                 "through: drop it"),
    "perf_dump_path": _PROFILING,
    "reference_url": _URL_FIELD,
    "video_url": _URL_FIELD,
    "extra_body": _EXTRA,
    "extra_params": _EXTRA,
    "return_frames": _request("the command line writes the MP4; the Python API's generate(..., return_frames=True) "
                              "returns the frames",
                              http_fix="the server delivers the MP4 at GET /v1/videos/{id}/content"),
    "return_trajectory_latents": _request(_TRAJECTORY),
    "return_trajectory_decoded": _request(_TRAJECTORY),
    "adjust_frames": _request(_FRAMES),
    "num_frames_round_down": _request(_FRAMES),
    "enable_teacache": _request("k6serve's step caching is Cache-DiT: --enable-cache-dit for one request, tuned "
                                "with --cache-dit-params, or the engine's --cache-dit-config for every request"),
    "profile": _PROFILING,
    "num_profiled_timesteps": _PROFILING,
    "profile_all_stages": _PROFILING,
    "data_type": _request("k6serve's output is always a video, written as MP4: drop it"),
    "no_override_protected_fields": _request("k6serve fills only the parameters a request leaves out with the "
                                             "model's defaults, never one it sets: drop it"),
    "enable_frame_interpolation": _request(_INTERPOLATION),
    "frame_interpolation_exp": _request(_INTERPOLATION),
    "frame_interpolation_scale": _request(_INTERPOLATION),
    "frame_interpolation_model_path": _request(_INTERPOLATION),
    "enable_upscaling": _UPSCALING,
    "upscaling_model_path": _UPSCALING,
    "upscaling_scale": _UPSCALING,
    "debug": _request("--log-level debug prints k6serve's debug log, its worker processes' too, and the traceback "
                      "above an error",
                      api_fix="k6serve logs through the logging module: logging.basicConfig(level=logging.DEBUG) "
                              "before from_pretrained(), which its worker processes follow",
                      http_fix="the server's log level is set when it starts, with --log-level debug"),
}

# Values of a k6serve option that the reference's same option takes and k6serve does not, by (option, value).
REFERENCE_VALUES: dict[tuple[str, str], str] = {
    ("performance_mode", "auto"): (
        "'auto' is SGLang's mode; k6serve does not pick a mode from the free GPU memory: choose speed (the default: "
        "every component on the GPU, compiled), balanced (each component on the GPU only for its stage) or memory "
        "(blocks streamed: the lowest peak)"),
    ("performance_mode", "manual"): (
        "'manual' is SGLang's mode; k6serve needs none, since the per component flags always win over a mode's "
        "defaults: choose speed (the default), balanced or memory, and place components with "
        "--cpu-offload-components, --layerwise-offload-components or --component-residency"),
}

# SGLang's config sections whose every dotted flag (`--dit-config.num-layers`) has the section's fix; a --config
# file's `dit-config:` mapping is the section's own key.
_SECTIONS = frozenset({"dit_config", "component_paths", "component_attention_backends"})
_REQUEST_FIELDS = frozenset(item.name for item in dataclasses.fields(SamplingParams))
_HTTP_REQUEST_FIELDS = frozenset(item.name for item in parameter_fields(surface="http"))
_FILE_FIELDS = ("input_reference", "video_reference")  # the HTTP API's uploads (serve.video_create_body.FILE_FIELDS)
_FLAG = re.compile(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)")


def aliases() -> dict[str, str]:
    """Every accepted reference name -> the k6serve option it renames (underscore names)."""
    return {name: entry.alias for name, entry in REFERENCE_NAMES.items() if entry.alias is not None}


def aliases_of(option: str) -> list[str]:
    """The reference names that `option` is also accepted under, as flags (`--mode` for performance_mode)."""
    return [flag_name(name) for name, alias in aliases().items() if alias == option]


def value_fix(option: str, value: object) -> str | None:
    """The fix for a value that the reference's same option takes and k6serve does not, or None."""
    return REFERENCE_VALUES.get((option, value)) if isinstance(value, str) else None


def _key(name: str) -> str:
    """`--enable-torch-compile`, `enable-torch-compile` or `enable_torch_compile` -> `enable_torch_compile`."""
    return name.split("=", 1)[0].lstrip("-").replace("-", "_")


def lookup(name: str, surface: str) -> tuple[str, ReferenceName] | None:
    """The table entry for a name as typed on `surface`, or None. On the command line (and in --config files) a
    `--no-` flag finds its switch; an alias has no `--no-` form (`--no-mode` is nobody's flag), and a Python keyword
    or a JSON field named `no_debug` is not SGLang's either."""
    key = _key(name)
    if (entry := _entry(key)) is not None:
        return key, entry
    switch = key.removeprefix("no_")
    if surface in ("cli", "serve") and switch != key and (entry := _entry(switch)) is not None \
            and entry.alias is None:
        return switch, entry
    return None


def _entry(key: str) -> ReferenceName | None:
    """`key`'s entry, or for a flag of a section in `_SECTIONS` (`component_paths.vae`) the section's."""
    section = key.split(".", 1)[0]
    return REFERENCE_NAMES.get(key) or (REFERENCE_NAMES[section] if section in _SECTIONS and key != section else None)


def _request_flags_as_names(text: str, fields: frozenset[str] = _REQUEST_FIELDS) -> str:
    """`--guidance-scale` -> `guidance_scale`, for the request parameters among `fields`; other flags stay."""
    def name(match: re.Match) -> str:
        field = match.group(1).replace("-", "_")
        return field if field in fields else match.group(0)

    return _FLAG.sub(name, text)


def _fix_text(entry: ReferenceName, surface: str) -> str:
    if entry.alias is not None:
        return f"k6serve calls it {entry.alias if surface == 'api' else flag_name(entry.alias)}"
    # Every entry without an alias is made by `_engine` or `_request`, which take a fix.
    assert entry.fix is not None, entry
    if surface == "cli":
        return entry.fix
    if entry.kind == ENGINE and surface != "api":
        # A flag of `k6serve serve` (over HTTP: the server's), whose requests come over HTTP: a request parameter
        # the fix names is a field there (`--output-path` stays, the server's own flag).
        return entry.http_fix or _request_flags_as_names(entry.fix, _HTTP_REQUEST_FIELDS)
    if surface == "api":
        from k6serve.api_errors import flags_as_keywords  # imports the config and model tables: only when needed

        return entry.api_fix or flags_as_keywords(_request_flags_as_names(entry.fix))
    # A request parameter sent over HTTP (`k6serve serve` takes request parameters only there).
    return entry.http_fix or entry.api_fix or _request_flags_as_names(entry.fix)


def reference_note(name: str, surface: str, *, named: bool = False) -> str | None:
    """What reference name `name` (as typed on `surface`) is and what to do instead, or None when it is not one;
    `named` starts the note with the name (for a message listing several)."""
    assert surface in SURFACES, surface
    found = lookup(name, surface)
    if found is None:
        return None
    key, entry = found
    if entry.kind == ENGINE and surface == "http":
        what = f"SGLang's server flag {flag_name(key)}, not a request field"
    elif entry.kind == REQUEST and surface == "serve":
        what = f"SGLang's request field {key}, sent in the POST /v1/videos body"
    elif surface == "api":
        what = "SGLang's " + ("option" if entry.kind == ENGINE else "parameter")
    else:
        what = "SGLang's " + ("field" if surface == "http" else "flag")
    return f"{name} is {what}; {_fix_text(entry, surface)}" if named else f"{what}; {_fix_text(entry, surface)}"


# k6serve's own names typed on a surface that spells them otherwise: the HTTP API's OpenAI fields on the command line
# and in the Python API (`--size` was answered "did you mean '--tp-size'?", `--seconds` "'--seed'?"), and names of
# other video APIs. Per surface, the note (command-line words on "cli", keywords on "api").
_OWN_NAMES: dict[str, dict[str, str]] = {
    "size": {
        "cli": "the HTTP API's field, OpenAI's \"WxH\" with the width first; here the size is --height and "
               "--width, e.g. --height 512 --width 768",
        "api": "the HTTP API's field, OpenAI's \"WxH\" with the width first; here the size is height and width, e.g. "
               "height=512, width=768"},
    "seconds": {
        "cli": "the HTTP API's field, OpenAI's; here a video's length is --num-frames, of the form 4k+1, at --fps, "
               "e.g. --num-frames 121 --fps 24 for 5 s",
        "api": "the HTTP API's field, OpenAI's; here a video's length is num_frames, of the form 4k+1, at fps, "
               "e.g. num_frames=121, fps=24 for 5 s"},
    "duration": {
        "cli": "k6serve sets a video's length with --num-frames, of the form 4k+1, at --fps, e.g. --num-frames 121 "
               "--fps 24 for 5 s",
        "api": "k6serve sets a video's length with num_frames, of the form 4k+1, at fps, e.g. num_frames=121, "
               "fps=24 for 5 s",
        "http": "k6serve takes a video's length as OpenAI's seconds, e.g. \"4\", or as num_frames (4k+1) at fps",
        "serve": "a video's length is chosen per request, in the POST /v1/videos body: seconds, or num_frames at "
                 "fps"},
    "input_reference": {
        "cli": "the HTTP API's upload field; here pass the file's path: --image-path FILE to generate from an "
               "image, --video-path FILE for super-resolution",
        "api": "the HTTP API's upload field; here pass the file's path: image_path to generate from an image, "
               "video_path for super-resolution"},
    "image_url": {"cli": _URLS, "api": _request_flags_as_names(_URLS), "http": _URLS_HTTP, "serve": _URLS_HTTP},
}
_OWN_NAMES["video_reference"] = _OWN_NAMES["input_reference"]
# `k6serve generate`'s flag, and an engine option of SGLang's (its DiffGenerator reads the file's prompts at
# generate()): in the Python API it got "did you mean 'return_file_paths_only'?", over HTTP no hint at all.
_OWN_NAMES["prompt_file_path"] = {
    "api": "`k6serve generate`'s flag; the Python API takes the prompts themselves, one request each: "
           "generate(prompt=[...]), e.g. with the file's lines that are not blank",
    "http": "`k6serve generate`'s flag; a job has one prompt: send one POST /v1/videos per prompt"}


# diffusers' own argument names (Kandinsky6TI2VAPipeline's and Kandinsky6SRPipeline's calls and from_pretrained),
# typed by someone moving working diffusers code over: difflib guessed at look-alikes ("output_type": "did you mean
# 'output_path'?", which wrote an MP4 into a folder named np; "--frame-rate": "'--lora-path'?"). Per surface, as
# `_OWN_NAMES`; a surface without an entry gets the guess.
def _diffusers(cli: str, api: str, http: str | None = None) -> dict[str, str]:
    return {"cli": cli, "api": api, **({"http": http} if http else {})}


_NO_NOISE_INPUTS = "k6serve draws the initial noise from the seed; it takes no ready-made latents"
_NO_EMBEDS = _diffusers("k6serve encodes the prompt itself: pass the text as --prompt and --negative-prompt",
                        "k6serve encodes the prompt itself: pass the text as prompt and negative_prompt",
                        "k6serve encodes the prompt itself: send the text as prompt and negative_prompt")
_NO_SCHEDULE = ("the sampler's timesteps are the checkpoint scheduler's own for the number of steps; no custom "
                "schedule is taken")
_PROGRESS = _diffusers(
    "the progress bar (or a line at each tenth of the steps where stderr is no terminal) shows each step; the "
    "Python API's on_progress gets them",
    "generate(..., on_progress=fn) calls fn(step, total) after each denoising step (no tensors); raising from it "
    "stops the request",
    "poll GET /v1/videos/{id}: progress advances at every denoising step")
_DIFFUSERS_NAMES: dict[str, dict[str, str]] = {
    "frame_rate": _diffusers("k6serve calls it --fps (1 to 240, default 24), e.g. --fps 24",
                             "k6serve calls it fps (1 to 240, default 24), e.g. fps=24",
                             "k6serve calls it fps (1 to 240, default 24)"),
    "generator": _diffusers(
        "pass --seed N: the generation noise comes from a CPU torch.Generator seeded with N, as diffusers' "
        "torch.Generator('cpu').manual_seed(N) gives it",
        "pass seed=N: the generation noise comes from a CPU torch.Generator seeded with N, as diffusers' "
        "torch.Generator('cpu').manual_seed(N) gives it",
        "send seed: the generation noise comes from a CPU torch.Generator seeded with it"),
    "output_type": _diffusers(
        "k6serve writes the MP4 (--output-path); the Python API's generate(..., return_frames=True) returns its "
        "frames",
        "generate(..., return_frames=True) returns result.frames, uint8 (frames, height, width, 3), the same as "
        "np.stack(output.frames[0]) of diffusers' 'pil' output, and result.audio, the waveform; with save_output "
        "(the default) the MP4 too. No float frames ('np', 'pt') or latents",
        "the server delivers the MP4 at GET /v1/videos/{id}/content"),
    "num_videos_per_prompt": _diffusers(
        "k6serve makes one video per request: run again with another --seed; --prompt-file-path runs several "
        "prompts on one model load",
        "k6serve makes one video per call: call generate() again with another seed (diffusers' batch of N from one "
        "generator has its own noise, which no seed reproduces)",
        "k6serve makes one video per job: send another request with another seed"),
    "callback_on_step_end": _PROGRESS,
    "callback_on_step_end_tensor_inputs": _PROGRESS,
    "return_dict": _diffusers("k6serve writes the MP4 and prints its path: drop it",
                              "generate() returns a VideoResult (output_file_path, frames, audio, timings, notes): "
                              "drop it", "a job's answer is its job object: drop it"),
    "latents": _diffusers(_NO_NOISE_INPUTS, _NO_NOISE_INPUTS, _NO_NOISE_INPUTS),
    "audio_latents": _diffusers(_NO_NOISE_INPUTS, _NO_NOISE_INPUTS, _NO_NOISE_INPUTS),
    "prompt_embeds": _NO_EMBEDS,
    "pooled_prompt_embeds": _NO_EMBEDS,
    "negative_prompt_embeds": _NO_EMBEDS,
    "negative_pooled_prompt_embeds": _NO_EMBEDS,
    "timesteps": _diffusers(_NO_SCHEDULE, _NO_SCHEDULE, _NO_SCHEDULE),
    "sigmas": _diffusers(_NO_SCHEDULE, _NO_SCHEDULE, _NO_SCHEDULE),
    "image": _diffusers("k6serve takes the image's file: --image-path FILE",
                        "k6serve takes the image's file: save it, e.g. image.save('first.png'), and pass "
                        "image_path='first.png'",
                        "upload the image as input_reference (multipart), or name a file on the server as "
                        "image_path"),
    "video": _diffusers("super-resolution takes the source's file: --video-path FILE",
                        "super-resolution takes the source's file: pass video_path='source.mp4' (save frames first, "
                        "e.g. diffusers.utils.export_to_video(frames, 'source.mp4', fps=24))",
                        "upload the source as input_reference (multipart), or name a file on the server as "
                        "video_path"),
    "resolution_scale": _diffusers("k6serve calls it --sr-resolution-scale (2, 4 or 2.25)",
                                   "k6serve calls it sr_resolution_scale (2, 4 or 2.25)",
                                   "k6serve calls it sr_resolution_scale (2, 4 or 2.25)"),
    "min_overlap": _diffusers("k6serve calls it --sr-tile-min-overlap (in [0, 1), default 0.2)",
                              "k6serve calls it sr_tile_min_overlap (in [0, 1), default 0.2)",
                              "k6serve calls it sr_tile_min_overlap (in [0, 1), default 0.2)"),
    "tiles_batch_size": _diffusers("k6serve calls it --sr-tiles-batch-size (1 to 64, default 1)",
                                   "k6serve calls it sr_tiles_batch_size (1 to 64, default 1)",
                                   "k6serve calls it sr_tiles_batch_size (1 to 64, default 1)"),
    "lq_noise_scale": _diffusers(*["the noise mixed into the source's latents is the checkpoint's own "
                                   "(transformer/config.json sr_params.lq_noise_scale, 0.7 as released); there is "
                                   "none to set per request"] * 3),
    "torch_dtype": _diffusers("k6serve calls it --dtype: auto (bfloat16 on CUDA, float32 on the CPU), bfloat16 or "
                              "float32", "k6serve calls it dtype: 'auto', 'bfloat16' (or torch.bfloat16) or "
                              "'float32'"),
    "device_map": _diffusers("k6serve places every component itself: --device and --num-gpus (with a parallel "
                             "layout) choose where, and --performance-mode balanced or memory offloads to host "
                             "memory, as diffusers' enable_model_cpu_offload does",
                             "k6serve places every component itself: device and num_gpus (with a parallel "
                             "layout) choose where, and performance_mode='balanced' or 'memory' offloads to host "
                             "memory, as diffusers' enable_model_cpu_offload does"),
    **{name: _diffusers("k6serve reads the checkpoint's safetensors weights (never .bin files, nor a variant's) "
                        "straight into place: drop it", "k6serve reads the checkpoint's safetensors weights (never "
                        ".bin files, nor a variant's) straight into place: drop it")
       for name in ("variant", "use_safetensors", "low_cpu_mem_usage")},
}


def diffusers_note(name: str, surface: str) -> str | None:
    """What to use instead of `name`, diffusers' argument typed on `surface`, or None when it is none (or has no
    note there)."""
    note = _DIFFUSERS_NAMES.get(_key(name), {}).get(surface)
    return None if note is None else f"diffusers' argument; {note}"


def own_name_note(name: str, surface: str) -> str | None:
    """What to use instead of `name`, one of k6serve's own names (or another API's) typed on `surface`, where it is
    not taken; None for any other name. On `k6serve serve` every request field is one: it is sent per request."""
    key = _key(name)
    if (note := _OWN_NAMES.get(key, {}).get(surface)) is not None:
        return note
    fields = _HTTP_REQUEST_FIELDS | {"size", "seconds", *_FILE_FIELDS}
    if surface == "serve" and (key in fields or key.startswith("no_") and key[3:] in fields):  # --no-enable-cache-dit
        return "a field of each POST /v1/videos request (docs/http-api.md), not a flag of the server"
    return None


def unknown_names_hint(unknown: list[str], known: Iterable[str], *, surface: str, named: bool | None = None) -> str:
    """The end of an "unknown name" error: ` (note)` for each reference name (`reference_note`) and each of
    k6serve's own names typed where they do not apply (`own_name_note`), and `did_you_mean`'s guess for the others
    (a typo). Names are as the surface spells them (flags on the command line), and so are `known`. `named` starts
    each note with its name; by default, when there are several (the caller knows of others it worded itself)."""
    named = len(unknown) > 1 if named is None else named
    notes = []
    rest = []
    for name in unknown:
        if lookup(name, surface) is not None:
            notes.append(f" ({reference_note(name, surface, named=named)})")
        elif (note := own_name_note(name, surface) or diffusers_note(name, surface)) is not None:
            notes.append(f" ({name}: {note})" if named else f" ({note})")  # a note may be a sentence of its own
        else:
            rest.append(name)
    return did_you_mean(rest, known, name_each=named) + "".join(notes)
