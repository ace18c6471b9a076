"""Devices and host memory, under everything else: the accelerator and its collective backend (`accelerator`),
the `torch.distributed` process group's life (`process_group`), large host buffers on huge pages and kept between
steps (`hostmem`), the step-sized buffers fzero reuses (`scratch`), and freed heap pages handed back during
constructions (`heap`).

May import: nothing of fzero.
"""
