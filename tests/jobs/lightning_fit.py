"""Lightning ``Trainer.fit`` with automatic optimization (the optimizer's step
runs forward and backward inside its closure) on a small CNN over tensors held
in memory, with a callback that logs each step's end (step_log.py)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from tests.jobs.step_log import StepLog, arguments, enable_probe


def main() -> int:
    args = arguments(__doc__ or "").parse_args()
    enable_probe()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    import lightning as L

    class SmallCnn(L.LightningModule):  # type: ignore[misc,unused-ignore]
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
            self.classifier = nn.Linear(32, 10)
            self.loss = nn.CrossEntropyLoss()

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = self.classifier(self.features(images).flatten(1))
            return logits

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            images, labels = batch
            loss: torch.Tensor = self.loss(self(images), labels)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    log = StepLog(args, "lightning")

    class StepEnds(L.Callback):  # type: ignore[misc,unused-ignore]
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if log.step_ended():
                trainer.should_stop = True

    data = torch.utils.data.TensorDataset(torch.randn(2048, 3, 32, 32),
                                          torch.randint(0, 10, (2048,)))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1000, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[StepEnds()])
    trainer.fit(SmallCnn(), loader)
    log.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
