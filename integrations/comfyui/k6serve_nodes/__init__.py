"""ComfyUI custom nodes that run Kandinsky 6 through a `k6serve serve` HTTP server.

Copy or symlink this folder into ComfyUI/custom_nodes/. It needs only torch, numpy and PyAV (`av`), which
ComfyUI already has; it does not import k6serve. Docs: docs/comfyui.md in the k6serve repository.
"""

from .nodes import K6ServeGenerate, K6ServeUpscale

NODE_CLASS_MAPPINGS = {
    "K6ServeGenerate": K6ServeGenerate,
    "K6ServeUpscale": K6ServeUpscale,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "K6ServeGenerate": "K6Serve Generate (Kandinsky 6 video + audio)",
    "K6ServeUpscale": "K6Serve Upscale (Kandinsky 6 video super-resolution)",
}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
