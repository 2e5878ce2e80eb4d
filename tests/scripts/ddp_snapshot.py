"""DDP training with snapshots, in the style of the PyTorch DDP tutorial series (torchrun
chapter): the Trainer saves a snapshot every ``save_every`` epochs and resumes from it when the
job is restarted, so a killed worker costs at most ``save_every`` epochs. Unlike the
tutorial, it ends with a barrier and drops the DDP wrapper before destroying the group
(see ``main``): a native abort at interpreter exit is torch's, not the launcher's.

CPU/gloo and a tiny model so that it runs anywhere. Test hook: ``PAUSE_AT_EPOCH=<n>`` and
``PAUSE_RANK=<r>`` make that rank, on the first attempt only, write ``$PAUSE_FILE`` (its pid)
and wait there, so a test can kill it at a known point.
"""

import gc
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import barrier, destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            _maybe_pause(epoch)
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def _maybe_pause(epoch):
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
            and epoch == int(os.environ.get("PAUSE_AT_EPOCH", "-1"))
            and os.environ.get("RANK") == os.environ.get("PAUSE_RANK", "1")):
        with open(os.environ["PAUSE_FILE"] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.environ["PAUSE_FILE"] + ".tmp", os.environ["PAUSE_FILE"])
        time.sleep(90)  # killed here by the test


def load_train_objs():
    train_set = MyTrainDataset(64)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    # Tear down while the interpreter is whole: wait for the peer (rank 0 may still be saving),
    # then drop the DDP wrapper (its reducer holds the process group and the last async works)
    # before the group. Left to interpreter finalisation, gloo's threads can release tensors
    # after Python is gone, and the process aborts ("terminate called without an active
    # exception") although training finished.
    barrier()
    del trainer
    gc.collect()
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=16, type=int,
                        help="Input batch size on each device (default: 16)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", type=str)
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)
