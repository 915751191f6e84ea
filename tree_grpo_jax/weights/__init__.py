"""Weight I/O shared by models, rewards, LoRA and export; it imports none of them.

files    reading safetensors, Flax msgpack and JSON, each failure one `ModelLoadError`
convert  PyTorch-named weights <-> Flax param trees (numpy only, no torch)
staging  folders built beside their destination and moved into place whole
"""
