"""Devices and host memory, under everything else: the accelerator and its collective backend (`accelerator`),
the `torch.distributed` process group's life (`process_group`), large host buffers on huge pages and kept between
steps (`hostmem`), and the step-sized buffers fzero reuses (`scratch`).

May import: nothing of fzero.
"""
