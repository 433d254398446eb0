"""Serving with vLLM: the disaggregated proxy the README deploys (`kvfsm.serving.proxy`, also
``python -m kvfsm.serving.proxy``) and the launcher of `vllm serve` engines with kvfsm as their
KV connector (`kvfsm.serving.serve`). Neither imports vLLM: the engines run in their own
processes."""
