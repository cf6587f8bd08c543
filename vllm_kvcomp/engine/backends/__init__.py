"""Attention-backend subclasses behind one worker interface: CPU (cpu.py), and on CUDA FLASH_ATTN
(flash_attn.py) and TRITON_ATTN (triton_attn.py); common.py holds what they share."""
