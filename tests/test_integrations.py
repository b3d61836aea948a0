"""keraunos with the training loops users reach for: Hugging Face ``Trainer``, Lightning's
``Trainer.fit`` and ``accelerate``, each with its defaults, on a tiny model built from a config
(random weights, nothing downloaded). Each run is compared with the same run in eager PyTorch:
the logged losses and the trained parameters.

What the libraries inspect and keraunos must present: ``inspect.signature(model.forward)`` (the
Trainer keeps only the dataset columns that ``forward`` names), ``type(model).forward`` and
``type(model).__name__`` (its label names), the state dict's keys (checkpoints), parameters.
"""
from __future__ import annotations

import copy
import glob
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import keraunos


def _assert_same_parameters(trained: torch.nn.Module, reference: torch.nn.Module) -> None:
    pairs = list(zip(trained.named_parameters(), reference.named_parameters()))
    assert pairs and len(pairs) == len(list(reference.parameters()))
    for (name, p), (ref_name, q) in pairs:
        assert name == ref_name
        torch.testing.assert_close(p, q, msg=name)


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _classification_data(n: int = 32) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g),
                                          torch.randint(0, 3, (n,), generator=g))


# ------------------------------------------------------------------------ Hugging Face Trainer
def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def _token_data(n: int) -> list[dict]:
    """Rows as a tokenized dataset holds them, with a column ``forward`` does not take (the
    Trainer must drop it, as it does for the eager model)."""
    g = torch.Generator().manual_seed(1)
    return [dict(input_ids=torch.randint(0, 64, (8,), generator=g),
                 attention_mask=torch.ones(8, dtype=torch.long),
                 labels=torch.randint(0, 3, (), generator=g), text=f"sentence {i}")
            for i in range(n)]


def _hf_train(model, output_dir):
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=str(output_dir), max_steps=3,
                             per_device_train_batch_size=4, logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    data = _token_data(16)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer.evaluate()["eval_loss"]


def test_hf_trainer_trains_a_jitted_model_with_its_defaults(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (test extra)")
    model = _tiny_bert()
    reference = copy.deepcopy(model)
    jmodel = keraunos.jit(model)
    # What the Trainer reads off the model, as the original shows it.
    assert inspect.signature(jmodel.forward) == inspect.signature(model.forward)
    assert type(jmodel).__name__ == "BertForSequenceClassification"
    losses, eval_loss = _hf_train(jmodel, tmp_path / "jit")
    expected_losses, expected_eval_loss = _hf_train(reference, tmp_path / "eager")
    assert len(losses) == 3
    torch.testing.assert_close(losses, expected_losses)
    torch.testing.assert_close(eval_loss, expected_eval_loss)  # label names found: eval has a loss
    _assert_same_parameters(model, reference)
    # Compiled for the first training step, again for the second (the first set
    # config.problem_type, which the program reads: as in eager, the second step finds it set),
    # and once for evaluation (grad mode off); every later step hit.
    assert keraunos.cache_misses(jmodel) == 3 and keraunos.cache_hits(jmodel) >= 1
    assert model.config.problem_type == reference.config.problem_type == \
        "single_label_classification"


# --------------------------------------------------------------------------------- Lightning
def _lightning_module(jit: bool):
    L = pytest.importorskip("lightning", reason="Lightning is in the test extra")

    class LitClassifier(L.LightningModule):
        def __init__(self, jit: bool = False):
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.model = keraunos.jit(Classifier()) if jit else Classifier()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LitClassifier, LitClassifier(jit=jit)


def _lightning_fit(module, root) -> None:
    import lightning as L
    with warnings.catch_warnings():  # Lightning's own notices about its defaults
        warnings.filterwarnings("ignore", message=".*(LeafSpec|log_every_n_steps|tensorboardX).*")
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", default_root_dir=str(root),
                            enable_progress_bar=False)
        trainer.fit(module, torch.utils.data.DataLoader(_classification_data(), batch_size=8))


def test_lightning_fits_a_module_whose_model_is_jitted_and_reloads_its_checkpoint(tmp_path):
    LitClassifier, jitted = _lightning_module(jit=True)
    _, eager = _lightning_module(jit=False)
    _lightning_fit(jitted, tmp_path / "jit")
    _lightning_fit(eager, tmp_path / "eager")
    _assert_same_parameters(jitted, eager)
    assert keraunos.cache_misses(jitted.model) == 1 and keraunos.cache_hits(jitted.model) == 7
    # The default ModelCheckpoint wrote a checkpoint with the eager model's keys; it loads back
    # into a module whose model is jitted (and into an eager one).
    (checkpoint,) = glob.glob(str(tmp_path / "jit" / "**" / "*.ckpt"), recursive=True)
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    assert sorted(state) == sorted(eager.state_dict())
    reloaded = LitClassifier.load_from_checkpoint(checkpoint)
    assert isinstance(reloaded.model, keraunos.JittedModule)
    _assert_same_parameters(reloaded, eager)
    x = torch.randn(4, 8)
    torch.testing.assert_close(reloaded.model(x), eager.model(x))


# -------------------------------------------------------------------------------- accelerate
def _accelerate_train(model, steps: int = 4) -> list[float]:
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_classification_data(), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for (x, y), _ in zip(loader, range(steps)):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert accelerator.unwrap_model(model) is model  # one process: nothing wrapped around it
    return losses


def test_accelerate_prepares_and_trains_a_jitted_model():
    pytest.importorskip("accelerate", reason="accelerate is in the test extra")
    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    jmodel = keraunos.jit(model)
    losses = _accelerate_train(jmodel)
    torch.testing.assert_close(losses, _accelerate_train(reference))
    _assert_same_parameters(model, reference)
    assert keraunos.cache_misses(jmodel) == 1 and keraunos.cache_hits(jmodel) == 3
