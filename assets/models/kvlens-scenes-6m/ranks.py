"""Data-parallel training for train_embedded.py: one process a GPU under torchrun (RANK,
WORLD_SIZE, LOCAL_RANK set), or one process alone. Gradients are averaged in one flat
all-reduce after backward (no DDP wrapper: the CLIP tower's last layer is unused by LLaVA's
feature layer -2, and its parameters get no gradient)."""
import os


class Ranks:
    def __init__(self, device_name):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.main = self.rank == 0
        self.dist = None
        if self.world > 1:
            import torch
            import torch.distributed as dist
            cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
            # gloo for host objects (no CUDA context before the image decoders fork), NCCL for GPU tensors
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
            self.dist = dist

    def share(self, make):
        """make() on rank 0; its (picklable) result on every rank."""
        if self.dist is None:
            return make()
        import torch
        box = [make() if self.main else None]
        self.dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
        return box[0]

    def device(self, name):
        """The device this rank trains on ("cuda" becomes this rank's GPU)."""
        import torch
        if name == "cuda" and self.world > 1:
            torch.cuda.set_device(self.local)
            return torch.device("cuda", self.local)
        return torch.device(name)

    def same_parameters(self, params):
        """Rank 0's initial parameters on every rank."""
        if self.dist is not None:
            for p in params:
                self.dist.broadcast(p.data, src=0)

    def average_gradients(self, params):
        """Gradients averaged over ranks; a parameter without one gets the average of zeros and
        the others' (every rank ends with the same gradient, so the same step)."""
        if self.dist is None:
            return
        import torch
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.dist.all_reduce(flat)
        flat.div_(self.world)
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(p)
            off += n

    def from_main(self, x, device):
        """Rank 0's float x on every rank."""
        if self.dist is None:
            return x
        import torch
        t = torch.tensor([x], dtype=torch.float64, device=device)
        self.dist.broadcast(t, src=0)
        return float(t.item())

    def max_over_ranks(self, x, device):
        """The largest of every rank's float x (x itself alone)."""
        if self.dist is None:
            return x
        import torch
        t = torch.tensor([x], dtype=torch.float64, device=device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def parameters_agree(self, params, device):
        """Whether every rank holds the same parameters (their sum, compared exactly)."""
        if self.dist is None:
            return True
        s = float(sum(p.detach().double().sum() for p in params))
        return self.max_over_ranks(s, device) == -self.max_over_ranks(-s, device)

    def close(self):
        if self.dist is not None:
            self.dist.destroy_process_group()
            self.dist = None
