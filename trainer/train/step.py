"""One optimizer step's parts: the loss of a micro-batch (the diffusers example's lines, for every family),
validation, and what the optimizer step needs around it."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from trainer.families.common.host_copy import to_device as host_to_device
from trainer.loss import choose_mask, make_noise, per_sample_loss, perturb_noise, weighted_mean
from trainer.optim.schedule import ComponentSchedule
from trainer.parallel.distributed import expand_rows, take_rows
from trainer.train.compile import eager_outside_training
from trainer.train.state import RunState
from trainer.train.transfer import to_device

log = logging.getLogger("atelier")


def forward_loss(state: RunState, batch, gen=None, device_gen=None):
    """The loss of one micro-batch: latents, noise and timesteps drawn from the run's generators (``gen`` and
    ``device_gen``: validation's own), the family's conditioning and prediction, the objective's target and
    weighting.

    Two generators, so that nothing of a step waits for the host: the tensors (posterior samples, noise,
    timesteps, input perturbation) come from ``device_gen``, on the training device; the choices the host makes
    (caption dropout, whether a mask is used, an inpainting mask's pick) from ``gen``, on the CPU. On the CPU
    they are one generator, drawn in the order they always were: a CPU run draws the numbers it drew before."""

    model = state.model
    objective = model.objective  # DDPM or flow matching, chosen by the family
    lc = state.cfg.loss
    if gen is None:  # all randomness of a step comes from these: exact resume
        gen, device_gen = state.generator, getattr(state, "device_generator", None)
    device_gen = gen if device_gen is None else device_gen
    # several processes: every draw is made for the whole global micro-batch (the same on every
    # process), each keeps its rows; so N processes equal one process with N x the batch
    rows = batch.get("global_rows")
    latents = model.sample_latents(expand_rows(batch["latent_dist"], rows), device_gen)
    noise = make_noise(latents.shape, device_gen, state.cfg.training.noise_offset).to(latents.device)
    timesteps = objective.sample_timesteps(latents.shape[0], lc, device_gen, latents).to(latents.device)
    noisy, target = objective.noisy_and_target(latents, noise, timesteps)
    if lc.input_perturbation > 0:  # the input gets extra noise; the target stays that of `noise`
        noisy, _ = objective.noisy_and_target(latents, perturb_noise(noise, lc.input_perturbation, device_gen),
                                              timesteps)
    mask = choose_mask(batch.get("mask"), lc, gen)
    noisy_latents, clean = noisy, latents  # before the model's own input channels (loss.precondition_outputs)
    noisy = model.model_input(noisy, batch, gen, state.warn)  # inpainting: noisy ‖ mask ‖ masked-image latents
    train_text = {"text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4", "embedding"} & set(
        state.method.modules)
    drops = {}  # per-encoder caption dropout: drawn only when on, so other runs keep their random stream
    for key, part in text_parts(state.cfg, model):
        if not part.enabled:  # switched off: the encoder only ever sees the empty caption
            drops[key] = [True] * latents.shape[0]
        elif part.caption_dropout > 0:
            drops[key] = (torch.rand(latents.shape[0], generator=gen) < part.caption_dropout).tolist()
    if rows is not None:
        noisy, target, timesteps = (take_rows(x, rows) for x in (noisy, target, timesteps))
        noisy_latents, clean = take_rows(noisy_latents, rows), take_rows(clean, rows)
        drops = {k: v[rows[0]:rows[1]] for k, v in drops.items()}
    with state.accelerator.autocast():
        cond = model.batch_condition(batch, state.method.expand_text, train_text, **drops)
        if state.unet_dtype is None:  # diffusers' .dtype walks every module (~8 ms a step on the tiny UNet)
            state.unet_dtype = model.denoiser.dtype
        model_pred = model.predict(noisy.to(state.unet_dtype), timesteps, cond)
    prior = batch.get("prior")  # on the host (transfer.HOST_KEYS): read there
    has_prior = prior is not None and bool(prior.any())
    if has_prior:  # prior_prediction rows: the base model's own prediction
        target = _prior_target(state, batch, noisy, timesteps, target, prior, drops)
    if lc.get("precondition_outputs", False):  # x̂0 = x_σ − σ·v̂ against x0: the σ²-weighted velocity loss
        if has_prior:  # the base model's x̂0 is the target of prior rows
            clean = torch.where(host_to_device(prior, clean.device).view(-1, *([1] * (clean.ndim - 1))),
                                objective.preconditioned(target, noisy_latents, clean, timesteps)[0], clean)
        model_pred, target = objective.preconditioned(model_pred, noisy_latents, clean, timesteps)
    losses = per_sample_loss(model_pred, target, lc, timesteps, objective,
                             mask=None if mask is None else host_to_device(mask, latents.device))  # pinned, no wait
    variance = getattr(model, "variance_loss", None)  # learned-variance models: their variational bound
    if variance is not None and lc.vb_strength > 0:
        vb = variance(take_rows(latents, rows) if rows is not None else latents, noisy, timesteps, model_pred)
        if vb is not None:
            losses = losses + lc.vb_strength * vb
    return weighted_mean(losses, batch["loss_weights"])


def text_parts(cfg, model) -> list:
    """``(drop key, parts entry)`` of each text encoder the step may drop a caption of: the first two always, the
    third and fourth where the family has them (SD3's T5, HiDream's T5 and Llama)."""
    parts = cfg.parts
    encoders = [("drop_te1", parts.text_encoder_1), ("drop_te2", parts.text_encoder_2)]
    for n in (3, 4):
        if model.info.part(f"text_encoder_{n}") is not None:
            encoders.append((f"drop_te{n}", parts[f"text_encoder_{n}"]))
    return encoders


def drops_captions(cfg, model) -> bool:
    """Whether the step drops captions itself (``parts.*.caption_dropout``, or an encoder switched off)."""
    return any(not part.enabled or part.caption_dropout > 0 for _, part in text_parts(cfg, model))


def _prior_target(state: RunState, batch, noisy, timesteps, target, prior, drops):
    """``target`` with the rows of prior_prediction concepts replaced by what the base model predicts for the same
    noisy input, caption and timestep — every adapter off, no gradient (OneTrainer's prior-prediction concepts,
    ai-toolkit's differential output preservation): the LoRA learns to leave those images as the model had them."""
    model = state.model
    with torch.no_grad(), state.method.adapters_off(), state.accelerator.autocast():
        cond = model.batch_condition(batch, state.method.expand_text, set(), **drops)
        base = model.predict(noisy.to(state.unet_dtype), timesteps, cond)
    rows = host_to_device(prior, target.device).view(-1, *([1] * (target.ndim - 1)))
    return torch.where(rows, base.to(target.dtype), target)


def validate(state: RunState) -> Optional[float]:
    """Mean loss over the validation concepts, with a fixed generator (same noise and timesteps every
    time, so the numbers are comparable) and the trained modules in eval mode; not trained on."""
    if not state.data.validation_batches() or not state.par.evaluates_here:
        return None  # DDP: rank 0 alone (no collectives); FSDP: every process runs the sharded UNet
    modes = {n: m.training for n, m in state.method.modules.items()}
    for m in state.method.modules.values():
        m.eval()
    gen = torch.Generator().manual_seed(int(state.cfg.general.seed) + 7919)
    device_gen = None if state.device.type == "cpu" else \
        torch.Generator(state.device).manual_seed(int(state.cfg.general.seed) + 7919)
    losses, sizes = [], []  # each batch's loss stays on the device until the pass ends: one read, not one a batch
    try:
        with torch.no_grad(), eager_outside_training(state.cfg):  # a whole compiled denoiser: eagerly
            for batch in state.data.iter_validation():
                sizes.append(len(batch["captions"]))
                losses.append(forward_loss(state, to_device(batch, state.device), gen, device_gen).float())
    finally:
        for n, m in state.method.modules.items():
            m.train(modes[n])
    total, count = 0.0, sum(sizes)
    for value, n in zip(torch.stack(losses).tolist() if losses else [], sizes):
        total += value * n
    loss = total / max(count, 1)
    state.run.events.emit("validation", step=state.pos.step, epoch=state.pos.epoch, loss=loss, images=count)
    if state.tb is not None:
        state.tb.add_scalar("validation_loss", loss, state.pos.step)
    log.info("validation loss %.5f (%d images)", loss, count)
    return loss


def apply_component_schedule(state: RunState) -> None:
    """parts.<part>.stop_after_steps/_epochs: freeze components whose window has ended (after
    every scheduler step, which writes their LR again, and after loading a backup)."""
    sched = state.component_schedule
    if sched is None:
        sched = state.component_schedule = ComponentSchedule(state.optimizer, state.cfg, state.steps_per_epoch)
    if sched:
        for name in sched.apply(state.pos.step):
            log.info("%s: training window over at step %d; its weights are frozen from now on", name,
                     state.pos.step)


def trained_params(state: RunState) -> set:
    """ids of the weights the optimizer trains (frozen components included: they stay in backups)."""
    return {id(p) for g in state.optimizer.param_groups for p in g["params"]}


def scaler_step(scaler, optimizer) -> bool:
    """fp16: the GradScaler's step (skipped when a gradient is inf/NaN) and scale update; returns
    whether the step was skipped. Read from the scaler's record of its unscale, between ``step`` and
    ``update``; a scaler class without that record is judged, as accelerate does, by a drop of the scale."""
    scaler.step(optimizer)
    try:
        found = scaler._found_inf_per_device(optimizer)
        skipped = any(bool(v.item()) for v in found.values())
    except Exception:
        skipped = None
        scale = scaler.get_scale()
    scaler.update()
    return skipped if skipped is not None else scaler.get_scale() < scale


def optimizer_step(state: RunState) -> None:
    """The optimizer step after the step's gradients are whole (averaged over the processes): unscale (fp16),
    clip, step (skipped on an fp16 overflow, and then the schedule does not advance), clear the gradients.

    fp16 on a GPU: accelerate's backward scaled the loss, but the optimizer is ours (never
    ``accelerator.prepare``'d), so unscaling and the overflow-skipping step are done here."""
    t = state.cfg.training
    scaler = state.accelerator.scaler
    if scaler is not None:
        scaler.unscale_(state.optimizer)
    if t.max_grad_norm > 0:
        state.accelerator.clip_grad_norm_([p for g in state.groups for p in g["params"]], t.max_grad_norm)
    overflowed = False
    if scaler is not None:
        overflowed = scaler_step(scaler, state.optimizer)
    else:
        state.optimizer.step()
    if not overflowed:  # as accelerate's own scheduler wrapper: a skipped step does not advance
        state.scheduler.step()  # the schedule (and torch warns about a step before optimizer.step)
    state.optimizer.zero_grad(set_to_none=True)
