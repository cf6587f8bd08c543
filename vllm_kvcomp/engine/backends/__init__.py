"""Attention-backend subclasses: CPU (cpu.py) and CUDA (cuda.py) behind one worker interface."""
