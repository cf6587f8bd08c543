"""Memory and throughput of kvcomp inside vLLM, full vs every policy (same as ``vllm-kvcomp bench``).

The implementation lives in ``vllm_kvcomp/eval/bench.py`` so the installed CLI has it too.
"""

from vllm_kvcomp.eval.bench import main

if __name__ == "__main__":
    main()
