"""One training job of ``benchmarks/goodput.py``, the same math under four ways of checkpointing.

How it measures, and what the numbers mean: ``docs/benchmarks/goodput.md``.

    python benchmarks/goodput_job.py --system S --run-dir D [--steps N] [--every-steps K]
        [--interval default|auto|SECONDS] [--url s3://BUCKET/PREFIX --endpoint URL]
"""

import time

STARTED = time.time()  # before anything else, torch's import included

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

SEED = 0
SAMPLES, BATCH, CLASSES = 4096, 64, 10
SHAPE = (3, 32, 32)
HIDDEN = 1536
LR = 1e-4
PER_EPOCH = SAMPLES // BATCH  # optimizer steps an epoch (drop_last)
UNSUPPORTED = 3  # exit status: this unbroken cannot run the asked configuration


# --------------------------------------------------------------------------- the job's parts


class Images(torch.utils.data.Dataset):
    """``SAMPLES`` random images and labels made from a fixed seed; each read is augmented
    with draws from torch's global generator (which each loader seeds its own way)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, *SHAPE, generator=g)
        w = torch.randn(SHAPE[0] * SHAPE[1] * SHAPE[2], CLASSES, generator=g)
        self.y = (self.x.flatten(1) @ w).argmax(1)  # learnable labels

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        dy, dx = torch.randint(0, 9, (2,)).tolist()
        x = torch.nn.functional.pad(x, (4, 4, 4, 4))[:, dy : dy + 32, dx : dx + 32]
        return x + 0.05 * torch.randn(SHAPE), self.y[i], i


def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    size = SHAPE[0] * SHAPE[1] * SHAPE[2]
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(size, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LR)


def torch_loader(dataset: Images) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        num_workers=0,
        generator=torch.Generator().manual_seed(SEED),
    )


def unbroken_loader(dataset: Images):
    import unbroken

    return unbroken.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, drop_last=True, num_workers=0, seed=SEED
    )


def loss_of(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y, _ = batch
    return torch.nn.functional.cross_entropy(model(x), y)


class Events:
    """``D/events.log``, appended one ``os.write`` per line."""

    def __init__(self, run_dir: Path) -> None:
        self.fd = os.open(run_dir / "events.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.first_done = False

    def write(self, *fields: object) -> None:
        os.write(self.fd, (" ".join(str(f) for f in fields) + "\n").encode())

    def resumed(self, step: int, probe: bool) -> None:
        self.write("probe" if probe else "resume", step)
        if probe:
            os._exit(0)  # what a restart would resume from; nothing trained, nothing saved

    def step(self, step: int, ids) -> None:
        if not self.first_done:
            self.first_done = True
            self.write("first", repr(time.time()))
        self.write("step", step, ",".join(str(int(i)) for i in ids))


def finish(model: torch.nn.Module, run_dir: Path, events: Events) -> None:
    partial = run_dir / "final.pt.partial"
    torch.save(model.state_dict(), partial)
    os.replace(partial, run_dir / "final.pt")
    events.write("done", repr(time.time()))


# --------------------------------------------------------------------------- the systems


def run_plain(args: argparse.Namespace, events: Events) -> None:
    model, dataset = make_model(), Images()
    optimizer = make_optimizer(model)
    loader = torch_loader(dataset)
    path = args.run_dir / "checkpoint.pt"
    epoch = step = 0
    if path.exists():
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        epoch, step = saved["epoch"], saved["step"]
    events.resumed(step, args.probe)
    model.train()
    while step < args.steps:
        for batch in loader:  # the saved epoch again from its first batch
            optimizer.zero_grad(set_to_none=True)
            loss_of(model, batch).backward()
            optimizer.step()
            step += 1
            events.step(step, batch[2])
            if args.every_steps and step % args.every_steps == 0 and step < args.steps:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                    "step": step,
                }
                began = time.perf_counter()
                partial = path.with_name(path.name + ".partial")
                torch.save(state, partial)
                os.replace(partial, path)
                events.write("saved", step, f"{time.perf_counter() - began:.4f}")
            if step >= args.steps:
                break
        epoch += 1
    finish(model, args.run_dir, events)


def run_lightning(args: argparse.Namespace, events: Events, exact: bool) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.dataset = Images()

        def train_dataloader(self):
            return unbroken_loader(self.dataset) if exact else torch_loader(self.dataset)

        def training_step(self, batch, batch_idx):
            self.ids = batch[2]
            return loss_of(self.net, batch)

        def configure_optimizers(self):
            return make_optimizer(self.net)

    class Log(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            events.resumed(trainer.global_step, args.probe)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            events.step(trainer.global_step, pl_module.ids)

    callbacks: list = [Log()]
    if exact:
        from unbroken.lightning import ExactResume

        callbacks.append(ExactResume())
    ckpt = args.run_dir / "ckpt"
    callbacks.append(
        ModelCheckpoint(
            dirpath=ckpt, every_n_train_steps=args.every_steps or None, save_top_k=0, save_last=True
        )
    )
    module = Module()
    trainer = L.Trainer(
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, ckpt_path="last" if (ckpt / "last.ckpt").exists() else None)
    finish(module.net, args.run_dir, events)


def run_trainer(args: argparse.Namespace, events: Events) -> None:
    import logging

    import unbroken

    # goodput.py reads the Trainer's start-up breakdown and interval lines, which a fresh start
    # logs at DEBUG.
    logging.getLogger("unbroken").setLevel(logging.DEBUG)

    batch_ids: list = []  # the sample ids of the batch in the step, from training_step

    class Log:
        def on_fit_start(self, trainer) -> None:
            events.resumed(trainer.progress.steps, args.probe)

        def on_optimizer_step(self, trainer) -> None:
            events.step(trainer.progress.steps, batch_ids[0])

    def training_step(model, batch):
        batch_ids[:] = [batch[2]]
        return loss_of(model, batch)

    options: dict = {}
    if args.interval == "auto":
        options["checkpoint_every_seconds"] = "auto"
    elif args.interval != "default":
        options["checkpoint_every_seconds"] = float(args.interval)
    if args.url:  # the run directory in object storage (a local S3 server)
        options["storage_options"] = {
            "endpoint_url": args.endpoint,
            "key": "testing",
            "secret": "testing",
        }
    try:  # built first, as the README says: a SIGTERM from here on is a preemption (exit 75)
        trainer = unbroken.Trainer(
            args.url or args.run_dir / "run",
            max_steps=args.steps,
            max_epochs=-(-args.steps // PER_EPOCH),
            seed=SEED,
            progress_bar=False,
            tensorboard=False,
            callbacks=[Log()],
            **options,
        )
    except (TypeError, ValueError) as error:
        if args.interval != "auto":
            raise
        print(
            f"goodput_job: this unbroken does not accept checkpoint_every_seconds='auto' "
            f"({type(error).__name__}: {error})",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(UNSUPPORTED)
    model, dataset = make_model(), Images()
    optimizer = make_optimizer(model)
    trainer.fit(model, optimizer, unbroken_loader(dataset), training_step=training_step)
    finish(model, args.run_dir, events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--system", required=True, choices=["plain", "lightning", "lightning-unbroken", "trainer"]
    )
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10 * PER_EPOCH, help="optimizer steps")
    parser.add_argument(
        "--every-steps",
        type=int,
        default=0,
        help="plain and lightning*: checkpoint every this many optimizer steps (0: never)",
    )
    parser.add_argument(
        "--interval", default="default", help="trainer: default, auto or a number of seconds"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--url", default=None, help="trainer: the run directory at this URL")
    parser.add_argument("--endpoint", default=None, help="with --url: the S3 server's endpoint")
    parser.add_argument("--probe", action="store_true", help="report the resume step, exit")
    args = parser.parse_args()
    if args.steps % PER_EPOCH:
        parser.error(f"--steps must be a multiple of {PER_EPOCH} (whole epochs), got {args.steps}")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    events = Events(args.run_dir)
    events.write("start", repr(STARTED), os.getpid())
    torch.set_num_threads(args.threads)
    if args.system == "plain":
        run_plain(args, events)
    elif args.system == "trainer":
        run_trainer(args, events)
    else:
        run_lightning(args, events, exact=args.system == "lightning-unbroken")


if __name__ == "__main__":
    main()
