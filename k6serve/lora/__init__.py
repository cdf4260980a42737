"""LoRA adapters for the Kandinsky 6 generation DiT, applied from outside the model.

`spec.py` holds the operations that cross process boundaries (torch-free), `arguments.py` checks the LoRA calls'
arguments and builds those operations (the API's and the HTTP routes', torch-free too), `adapter.py` reads an
adapter file (found by `adapter_file.py`; its keys parsed by `state_dict.py`, with the PEFT config that came with
it checked by `peft_config.py`), `targets.py` maps its module paths onto the model's Linears (fused projections
included), `sharding.py` finds a tensor-parallel or FSDP shard's block of a weight, `dora.py` computes DoRA's row
norms (on shards too) and caches them for the dynamic path, `dynamic.py` adds updates at run time, and
`manager.py`'s `LoraManager` merges, unmerges and keeps the state. The worker owns one manager per DiT
(`ModelWorker.apply_lora_operation`). Nothing is imported here, so `k6serve.lora.spec` stays importable without
torch.
"""
