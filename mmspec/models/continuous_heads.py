"""Per-token heads of continuous-token AR models and their ``TokenDist``s, plus CSpD's reference rule.

Tokens have shape ``(2, d)``: row 0 is the *state* the backbone reads back, row 1 the *latent*
the image decoder uses. A diffusion head ends its denoising chain at a state x_1 (the chain's
lowest noise level) and emits the latent ``x_0 = F(x_1)``, its noiseless last step (MAR). The
backbone must read x_1, not x_0: the lossless ``path`` rule emits the *target's* last step
``F_p(x_1)`` on the draft's path, which the draft cannot compute, so a backbone that read x_0
would have verified every later drafted token on the wrong prefix (a causal verify pass feeds the
drafts) and could keep at most one token per pass. With x_1 read back, draft and target share the
state and only the emitted latent differs. The mixture head draws the latent and then the state
with the same forward kernel ``x_1 = a x_0 + b eps`` (``a, b`` of the chain's lowest noise level),
so one backbone serves both heads; for the default cosine schedule ``b ~ 0.006``.

- ``GaussianMixtureHead`` -> ``GaussianMixture``: GIVT-style mixture (Tschannen et al., 2024),
  exact densities, MAR-convention CFG as a per-component product ``p_c^s p_u^(1-s)`` (again a
  mixture with an exact density), temperature on the standard deviations.
- ``DiffusionHead`` (MAR's ``SimpleMLPAdaLN``, Li et al., 2024, "Autoregressive Image Generation
  without Vector Quantization"; DDPM cosine schedule, learned-range variance, respaced sampling)
  -> ``DiffusionTokens``: densities on the whole denoising path, scored by the target in one
  batched head call, emitting the target's last step (the ``path`` rule).

Densities are float64; networks run in their own dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from diffusers.models.embeddings import get_timestep_embedding
from torch import nn
from torch.nn import functional as F

from ..core.distributions import (LOG_2PI, DensityProcessor, Draw, HeadMeter, TokenDist, normal_log_prob,
                                  state_latent_token)
from ..core.errors import check, check_int, is_int
from ..core.logits import cfg_merge
from ..core.sampling import Generators, inverse_cdf, rand, randn

__all__ = ["DiffusionHead", "DiffusionSchedule", "DiffusionTokens", "GaussianMixture",
           "GaussianMixtureHead", "SimpleMLPAdaLN"]


def _std_normal_cdf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.erfc(-z / math.sqrt(2.0))


# ================================================================ Gaussian mixture head

@dataclass
class GaussianMixture(TokenDist):
    """Per-position mixtures ``p(x_0) = sum_m pi_m N(x_0; mu_m, diag sigma_m^2)`` over the latent,
    and the state ``x_1 = a x_0 + b eps`` (``state_kernel = (a, b)``, the same for draft and
    target, so it cancels in every density ratio).

    ``log_prob`` is the float64 joint density of a token (the latent's mixture density times the
    kernel's, which is left out when ``b = 0``: the state is then a function of the latent).
    Sampling draws, per row, one uniform (the component) and d normals (and d more for the state
    when ``b > 0``); the latent is rounded to ``token_dtype`` before it is scored.
    """

    log_pi: torch.Tensor  # (*batch, M) normalised log weights
    mu: torch.Tensor  # (*batch, M, d)
    sigma: torch.Tensor  # (*batch, M, d)
    state_kernel: tuple[float, float] = (1.0, 0.0)
    token_dtype: torch.dtype = torch.float32
    meter: HeadMeter | None = field(default=None, repr=False)
    max_tries: int | None = 1000

    @property
    def token_shape(self) -> tuple[int, ...]:
        return (2, self.mu.shape[-1])

    def _batch_ndim(self) -> int:
        return self.log_pi.dim() - 1

    @staticmethod
    def guided(cond: tuple, uncond: tuple, scale: torch.Tensor) -> tuple:
        """MAR-convention CFG on mixtures: component m and dimension j of ``p_c^s p_u^(1-s)``,
        renormalised (GIVT's ``w = s - 1``): ``lam = s / sigma_c^2 - (s - 1) / sigma_u^2``; where
        ``lam > 0``, ``sigma^2 = 1 / lam`` and ``mu = (s mu_c / sigma_c^2 - (s - 1) mu_u / sigma_u^2)
        / lam``, elsewhere the conditional component is kept; ``pi = pi_c``. ``scale`` has the batch
        shape; parameters are ``(log_pi, mu, sigma)``."""
        log_pi, mu_c, sig_c = cond
        _, mu_u, sig_u = uncond
        s = scale[..., None, None]
        prec_c, prec_u = sig_c ** -2, sig_u ** -2
        lam = s * prec_c - (s - 1) * prec_u
        ok = lam > 0
        lam_safe = torch.where(ok, lam, 1.0)
        mu = torch.where(ok, (s * mu_c * prec_c - (s - 1) * mu_u * prec_u) / lam_safe, mu_c)
        sigma = torch.where(ok, lam_safe.rsqrt(), sig_c)
        return log_pi, mu, sigma

    def latent_log_prob(self, latent: torch.Tensor) -> torch.Tensor:
        """(*batch, d) latents -> (*batch,) float64 mixture log-density."""
        z = (latent.double()[..., None, :] - self.mu) / self.sigma  # (*batch, M, d)
        comp = torch.add(self.log_pi, torch.linalg.vecdot(z, z), alpha=-0.5) - self.sigma.log().sum(-1)
        return torch.logsumexp(comp, -1) - 0.5 * latent.shape[-1] * LOG_2PI

    def log_prob(self, draw: Draw) -> torch.Tensor:
        state, latent = draw.token.double().unbind(-2)
        lp = self.latent_log_prob(latent)
        a, b = self.state_kernel
        if b > 0:  # the kernel N(state; a latent, b^2 I), in closed form
            r = torch.sub(state, latent, alpha=a)
            lp = torch.add(lp, torch.linalg.vecdot(r, r), alpha=-0.5 / (b * b)) - latent.shape[-1] * (
                math.log(b) + 0.5 * LOG_2PI)
        return lp

    def noise(self, generator: Generators = None) -> torch.Tensor:
        """(n, 1 + d [+ d]) float64: the component's uniform, the latent's d normals and, when
        ``b > 0``, the state's d normals, drawn per row in that order."""
        n, d = self.log_pi.shape[0], self.mu.shape[-1]
        device = self.log_pi.device
        parts = [rand((n, 1), generator, device, torch.float64), randn((n, d), generator, device, torch.float64)]
        if self.state_kernel[1] > 0:
            parts.append(randn((n, d), generator, device, torch.float64))
        return torch.cat(parts, -1)

    def from_noise(self, noise: torch.Tensor) -> Draw:
        n, d = self.log_pi.shape[0], self.mu.shape[-1]
        k = inverse_cdf(self.log_pi.exp(), noise[:, :1])  # (n,) components
        rows = torch.arange(n, device=noise.device)
        mu, sigma = self.mu[rows, k], self.sigma[rows, k]  # (n, d)
        latent = (mu + sigma * noise[:, 1:1 + d]).to(self.token_dtype).double()
        a, b = self.state_kernel
        state = a * latent
        if b > 0:
            state = state + b * noise[:, 1 + d:]
        draw = Draw(state_latent_token(state, latent, self.token_dtype))
        draw.log_prob = self.log_prob(draw)
        return draw

    def sample(self, generator: Generators = None) -> Draw:
        return self.from_noise(self.noise(generator))

    def rosenblatt(self, latent: torch.Tensor) -> torch.Tensor:
        """The Rosenblatt transform (*batch, d) -> (*batch, d): ``u_j = F(x_j | x_<j)`` under the
        mixture, with posterior component weights ``w_m ~ pi_m prod_{i<j} N(x_i; mu_mi, sigma_mi)``.
        Latents drawn from this distribution give iid U(0, 1) coordinates."""
        x = latent.double()
        logw = self.log_pi.clone()
        us = []
        for j in range(x.shape[-1]):
            mu, sigma, xj = self.mu[..., j], self.sigma[..., j], x[..., j, None]
            us.append((logw.softmax(-1) * _std_normal_cdf((xj - mu) / sigma)).sum(-1))
            logw = logw + normal_log_prob(xj, mu, sigma)
        return torch.stack(us, -1)


class GaussianMixtureHead(nn.Module):
    """A per-token Gaussian-mixture head (GIVT's, Tschannen et al., 2024): an MLP
    ``dim -> hidden -> M (1 + 2 d)`` gives mixture logits, means and ``sigma = sigma_min +
    softplus(raw)`` (the floor keeps flat patches from driving the NLL to -inf).

    ``distribution`` applies the pipeline's CFG (``GaussianMixture.guided``, one head call on both
    halves) and then its temperature (``sigma <- T sigma``). ``state_kernel`` (a, b) is set by the
    model: the forward kernel of its diffusion chain's lowest noise level.
    """

    def __init__(self, dim: int, token_dim: int, components: int = 8, hidden: int = 128, sigma_min: float = 1e-2):
        super().__init__()
        for name, value in (("dim", dim), ("token_dim", token_dim), ("components", components), ("hidden", hidden)):
            check_int(value, name, 1)
        check(sigma_min > 0, "sigma_min", "> 0", sigma_min)
        self.token_dim, self.components, self.sigma_min = token_dim, components, float(sigma_min)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, components * (1 + 2 * token_dim)))
        self.state_kernel = (1.0, 0.0)

    @property
    def token_shape(self) -> tuple[int, ...]:
        return (2, self.token_dim)

    def raw_params(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., dim) features -> log weights (..., M), means and stds (..., M, d), in z's dtype."""
        M, d = self.components, self.token_dim
        out = self.net(z)
        logits, mu, raw = out.split([M, M * d, M * d], -1)
        sigma = self.sigma_min + F.softplus(raw)
        return logits.log_softmax(-1), mu.unflatten(-1, (M, d)), sigma.unflatten(-1, (M, d))

    def nll(self, z: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """(..., dim) features, (..., d) latents -> (...,) negative log-likelihood in nats (the
        training loss; unguided, untempered)."""
        log_pi, mu, sigma = self.raw_params(z)
        x = latent[..., None, :]
        comp = (-0.5 * ((x - mu) / sigma) ** 2 - sigma.log() - 0.5 * math.log(2 * math.pi)).sum(-1)
        return -torch.logsumexp(log_pi + comp, -1)

    def distribution(self, cond: torch.Tensor, uncond: torch.Tensor | None, scale: torch.Tensor | None,
                     pipeline: DensityProcessor, meter: HeadMeter | None) -> GaussianMixture:
        z = cond if uncond is None else torch.cat([cond, uncond])
        if meter is not None:
            meter.record_call(z.shape[:-1].numel())
        params = tuple(t.double() for t in self.raw_params(z))
        if uncond is not None:
            B = cond.shape[0]
            params = GaussianMixture.guided(tuple(t[:B] for t in params), tuple(t[B:] for t in params), scale)
        log_pi, mu, sigma = params
        return GaussianMixture(log_pi, mu, sigma * pipeline.temperature, self.state_kernel, cond.dtype, meter,
                               pipeline.residual_max_tries)


# ================================================================ diffusion head

def _space_timesteps(train_steps: int, count: int) -> list[int]:
    """IDDPM's ``space_timesteps(train_steps, [count])``: ``count`` evenly strided steps from 0 to
    ``train_steps - 1`` (rounded), as MAR respaces (``timestep_respacing="100"``)."""
    if count == 1:
        return [0]
    stride = (train_steps - 1) / (count - 1)
    cur, taken = 0.0, []
    for _ in range(count):
        taken.append(round(cur))
        cur += stride
    return taken


class DiffusionSchedule:
    """A DDPM cosine schedule (Nichol & Dhariwal, 2021) over ``train_steps``, respaced to the
    sampling ``timesteps`` (ascending original steps; default ``sampling_steps`` evenly strided
    ones, IDDPM's respacing, which MAR uses).

    Respaced index k runs 0 .. K-1 (noisiest last). Float64 tables: ``alphas_cumprod`` per index,
    ``betas`` of the respaced chain, the posterior ``q(x_{k-1} | x_k, x_0)`` coefficients
    ``coef_x0``, ``coef_xt``, its variance clipped at index 0 (``log_var_min``), ``log_var_max =
    log beta`` (the learned range's ends), and the train schedule's ``train_alphas_cumprod``.
    """

    def __init__(self, train_steps: int = 1000, sampling_steps: int = 20, timesteps: list[int] | None = None):
        check_int(train_steps, "train_steps", 2)
        if timesteps is None:
            check_int(sampling_steps, "sampling_steps", 1, train_steps)
            timesteps = _space_timesteps(train_steps, sampling_steps)
        timesteps = list(timesteps)
        check(len(timesteps) >= 1 and all(is_int(t) and 0 <= t < train_steps for t in timesteps)
              and timesteps == sorted(set(timesteps)), "timesteps",
              f"strictly increasing ints in [0, {train_steps})", timesteps)
        self.train_steps = train_steps
        steps = torch.arange(train_steps + 1, dtype=torch.float64) / train_steps
        f = torch.cos((steps + 0.008) / 1.008 * math.pi / 2) ** 2
        train_betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
        self.train_alphas_cumprod = torch.cumprod(1 - train_betas, 0)
        self.timesteps = torch.tensor(timesteps, dtype=torch.long)
        ab = self.train_alphas_cumprod[self.timesteps]
        ab_prev = torch.cat([torch.ones(1, dtype=torch.float64), ab[:-1]])
        betas = 1 - ab / ab_prev
        post_var = betas * (1 - ab_prev) / (1 - ab)
        clip = post_var[1] if len(timesteps) > 1 else betas[0]
        self.alphas_cumprod, self.betas = ab, betas
        self.coef_x0 = betas * ab_prev.sqrt() / (1 - ab)
        self.coef_xt = (1 - ab_prev) * (1 - betas).sqrt() / (1 - ab)
        self.log_var_min = torch.cat([clip.view(1), post_var[1:]]).log()
        self.log_var_max = betas.log()
        self.sqrt_recip_ab = ab.rsqrt()
        self.sqrt_recipm1_ab = (1 / ab - 1).sqrt()

    @property
    def steps(self) -> int:
        """K: states on a sampling chain (x_{K-1} .. x_0-state), one head call each."""
        return len(self.timesteps)

    @property
    def state_kernel(self) -> tuple[float, float]:
        """(a, b): the chain's last state is distributed as ``a x_0 + b eps`` for a perfect head."""
        ab = float(self.alphas_cumprod[0])
        return math.sqrt(ab), math.sqrt(1 - ab)


def _modulate(x, shift, scale):
    return x * (1 + scale) + shift


class _ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x, y):
        shift, scale, gate = self.ada(y).chunk(3, -1)
        return x + gate * self.mlp(_modulate(self.in_ln(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """MAR's diffusion-head network (``models/diffloss.py``): ``x_t`` projected to ``width``,
    ``blocks`` residual MLP blocks with AdaLN modulation by ``time embedding + Linear(z)``, an
    AdaLN final layer to ``out_channels``. Initialised as MAR (xavier linears, zero modulation
    and output), so a fresh head predicts zero.
    """

    def __init__(self, in_channels: int, width: int, out_channels: int, z_channels: int, blocks: int,
                 freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_embed = nn.Sequential(nn.Linear(freq_dim, width), nn.SiLU(), nn.Linear(width, width))
        self.cond_embed = nn.Linear(z_channels, width)
        self.input_proj = nn.Linear(in_channels, width)
        self.res_blocks = nn.ModuleList(_ResBlock(width) for _ in range(blocks))
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.final_linear = nn.Linear(width, out_channels)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        for lin in (self.time_embed[0], self.time_embed[2]):
            nn.init.normal_(lin.weight, std=0.02)
        for ada in [b.ada for b in self.res_blocks] + [self.final_ada]:
            nn.init.zeros_(ada[-1].weight)
            nn.init.zeros_(ada[-1].bias)
        nn.init.zeros_(self.final_linear.weight)
        nn.init.zeros_(self.final_linear.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """(n, in) noisy inputs, (n,) original timesteps, (n, z) conditions -> (n, out)."""
        steps, which = t.unique(return_inverse=True)  # a call sees a few distinct steps: embed each once
        # DiT's / MAR's sinusoids, cosines first
        emb = get_timestep_embedding(steps, self.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        emb = self.time_embed(emb.to(x.dtype))[which]
        y = emb + self.cond_embed(c)
        h = self.input_proj(x)
        for block in self.res_blocks:
            h = block(h, y)
        shift, scale = self.final_ada(y).chunk(2, -1)
        return self.final_linear(_modulate(self.final_norm(h), shift, scale))


class DiffusionHead(nn.Module):
    """MAR's per-token diffusion head: ``SimpleMLPAdaLN`` predicting epsilon (and, with
    ``learn_sigma``, the learned-range variance ``log var = f log beta + (1 - f) log var_post``,
    ``f = (v + 1) / 2``) under a DDPM cosine schedule, sampled on K respaced steps.

    A sampling chain draws ``x_{K-1} ~ N(0, I)`` and for k = K-1 .. 1 ``x_{k-1} = mu(x_k, k) + T
    sigma_k eps`` (MAR's temperature T scales the noise, not the start), ending at the state x_0
    (index 0) and emitting the latent ``mu(x_0, 0) = x0_hat``, the noiseless last step. CFG (MAR's
    ``forward_with_cfg``) guides epsilon, ``eps_u + s (eps_c - eps_u)``, and takes the variance from
    the conditional half.
    """

    def __init__(self, token_dim: int, z_channels: int, width: int = 128, blocks: int = 3, learn_sigma: bool = True,
                 train_steps: int = 1000, sampling_steps: int = 20, timesteps: list[int] | None = None):
        super().__init__()
        for name, value in (("token_dim", token_dim), ("z_channels", z_channels), ("width", width)):
            check_int(value, name, 1)
        check_int(blocks, "blocks", 0)
        self.token_dim, self.learn_sigma = token_dim, bool(learn_sigma)
        self.net = SimpleMLPAdaLN(token_dim, width, token_dim * (2 if learn_sigma else 1), z_channels, blocks)
        self.schedule = DiffusionSchedule(train_steps, sampling_steps, timesteps)

    @property
    def token_shape(self) -> tuple[int, ...]:
        return (2, self.token_dim)

    @property
    def state_kernel(self) -> tuple[float, float]:
        return self.schedule.state_kernel

    def guided_step(self, x: torch.Tensor, k: torch.Tensor, z: torch.Tensor, z_u: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None, meter: HeadMeter | None = None):
        """One head call on states ``x`` (n, d) at respaced indices ``k`` (n,) with conditions z
        (n, H) (and z_u, scale (n,) for CFG) -> float64 ``(x0_hat, mean, log_var)`` (n, d) of
        ``p(x_{k-1} | x_k)``; at index 0 the mean is x0_hat."""
        S, d = self.schedule, self.token_dim
        n = x.shape[0]
        dtype = z.dtype
        t = S.timesteps[k.cpu()].to(x.device)
        if z_u is None:
            out = self.net(x.to(dtype), t, z)
        else:
            out = self.net(torch.cat([x, x]).to(dtype), torch.cat([t, t]), torch.cat([z, z_u]))
        if meter is not None:
            meter.record_call(out.shape[0])
        out = out.double()
        eps = out[:n, :d]
        if z_u is not None:
            eps = cfg_merge(eps, out[n:, :d], scale.double()[:, None])
        kc = k.cpu()
        col = lambda table: table[kc].to(x.device)[:, None]  # noqa: E731  (n, 1) per-row coefficient
        x = x.double()
        x0 = col(S.sqrt_recip_ab) * x - col(S.sqrt_recipm1_ab) * eps
        mean = col(S.coef_x0) * x0 + col(S.coef_xt) * x
        if self.learn_sigma:
            frac = (out[:n, d:] + 1) / 2
            log_var = frac * col(S.log_var_max) + (1 - frac) * col(S.log_var_min)
        else:
            log_var = col(S.log_var_min).expand_as(mean)
        return x0, mean, log_var

    def loss(self, z: torch.Tensor, latent: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """(n, H) features, (n, d) latents -> (n,) training loss at a random train timestep: the
        epsilon MSE plus, with ``learn_sigma``, the variational bound term with the mean frozen
        (IDDPM's hybrid loss, as MAR trains it; the t = 0 term is a Gaussian NLL in bits instead
        of IDDPM's discretised image likelihood, since latents are not 8-bit pixels)."""
        S, d = self.schedule, self.token_dim
        n = latent.shape[0]
        device = latent.device
        t = torch.randint(0, S.train_steps, (n,), generator=generator, device="cpu")
        noise = torch.randn(latent.shape, generator=generator, device="cpu").to(device, latent.dtype)
        ab = S.train_alphas_cumprod[t].to(device)[:, None]
        x_t = (ab.sqrt() * latent.double() + (1 - ab).sqrt() * noise.double()).to(latent.dtype)
        out = self.net(x_t, t.to(device), z)
        mse = ((out[:, :d] - noise) ** 2).mean(-1)
        if not self.learn_sigma:
            return mse
        # the bound on the train schedule, with the network's mean frozen (only the variance learns)
        ab_t = S.train_alphas_cumprod.to(device)
        ab_prev = torch.cat([torch.ones(1, dtype=torch.float64, device=device), ab_t[:-1]])
        beta = 1 - ab_t / ab_prev
        post_var = beta * (1 - ab_prev) / (1 - ab_t)
        log_min = torch.cat([post_var[1:2], post_var[1:]]).log()[t.to(device)][:, None]
        log_max = beta.log()[t.to(device)][:, None]
        c0 = (beta * ab_prev.sqrt() / (1 - ab_t))[t.to(device)][:, None]
        ct = ((1 - ab_prev) * (1 - beta).sqrt() / (1 - ab_t))[t.to(device)][:, None]
        x_td = x_t.double()
        true_mean = c0 * latent.double() + ct * x_td
        true_log_var = log_min  # IDDPM's clipped posterior variance
        eps = out[:, :d].detach().double()
        x0_hat = (1 / ab.sqrt()) * x_td - (1 / ab - 1).sqrt() * eps
        mean = c0 * x0_hat + ct * x_td
        frac = (out[:, d:].double() + 1) / 2
        log_var = frac * log_max + (1 - frac) * log_min
        kl = 0.5 * (-1 + log_var - true_log_var + (true_log_var - log_var).exp()
                    + (true_mean - mean) ** 2 * (-log_var).exp())
        nll = -normal_log_prob(latent.double(), mean, (0.5 * log_var).exp())
        vb = torch.where((t.to(device) == 0)[:, None], nll, kl).mean(-1) / math.log(2.0)
        return mse + vb.to(mse.dtype)

    def distribution(self, cond: torch.Tensor, uncond: torch.Tensor | None, scale: torch.Tensor | None,
                     pipeline: DensityProcessor, meter: HeadMeter | None) -> "DiffusionTokens":
        return DiffusionTokens(cond, uncond, scale, self, float(pipeline.temperature), cond.dtype, meter,
                               pipeline.residual_max_tries)


@dataclass
class DiffusionTokens(TokenDist):
    """A diffusion head's per-position token distributions, as densities on the denoising *path*
    ``X = (x_{K-1}, .., x_0)`` (Gaussian transitions, float64):

        log P(X) = log N(x_{K-1}; 0, I) + sum_{k=K-1..1} log N(x_{k-1}; mu(x_k, k, z), (T sigma_k)^2 I)

    A ``Draw``'s aux holds the path (``"path"`` (…, K, d)), the noise that drew it (``"noise"``:
    x_{K-1} then eps_{K-1} .. eps_1), ``"log_sigma"`` (sum of the untempered log sigma_k, k >= 1)
    and ``"sigma0"`` (T sigma_0); its token is (state x_0, latent mu(x_0, 0)).

    ``score(draw)`` evaluates log P and the emitted latent ``F(x_0) = mu(x_0, 0)`` on the draw's
    own states in *one* batched head call (K rows per token, twice with CFG): the ``path`` rule.
    Speculative sampling on paths returns X ~ P exactly, and the token is the target's own last
    step applied to it, so decoding is lossless; emitting the draft's last step is not. The
    residual's tries are full target chains plus one draft-head call each (``Residual``).
    """

    cond: torch.Tensor  # (*batch, H)
    uncond: torch.Tensor | None
    scale: torch.Tensor | None  # (*batch,) float64 CFG scales
    head: DiffusionHead = field(repr=False)
    temperature: float = 1.0
    token_dtype: torch.dtype = torch.float32
    meter: HeadMeter | None = field(default=None, repr=False)
    max_tries: int | None = 1000

    @property
    def token_shape(self) -> tuple[int, ...]:
        return (2, self.head.token_dim)

    def _batch_ndim(self) -> int:
        return self.cond.dim() - 1

    def _flat(self, repeat: int = 1):
        """(n * repeat, ...) conditions for a call on ``repeat`` states per entry."""
        nb = self._batch_ndim()

        def rep(t):
            return None if t is None else t.reshape(-1, *t.shape[nb:]).repeat_interleave(repeat, 0)

        return rep(self.cond), rep(self.uncond), rep(self.scale)

    def sample(self, generator: Generators = None) -> Draw:
        head, T = self.head, self.temperature
        K, d = head.schedule.steps, head.token_dim
        n, device = self.cond.shape[0], self.cond.device
        z, z_u, s = self._flat()
        x = randn((n, d), generator, device, torch.float64)
        path, noise = [x], [x]
        logp = normal_log_prob(x, torch.zeros_like(x), torch.ones_like(x)).sum(-1)
        log_sigma = torch.zeros_like(x)
        for k in range(K - 1, 0, -1):
            _, mean, log_var = head.guided_step(x, torch.full((n,), k), z, z_u, s, self.meter)
            std = T * (0.5 * log_var).exp()
            eps = randn((n, d), generator, device, torch.float64)
            x = mean + std * eps
            logp = logp + normal_log_prob(x, mean, std).sum(-1)
            log_sigma = log_sigma + 0.5 * log_var
            path.append(x)
            noise.append(eps)
        x0, _, log_var0 = head.guided_step(x, torch.zeros(n, dtype=torch.long), z, z_u, s, self.meter)
        aux = {"path": torch.stack(path, 1), "noise": torch.stack(noise, 1), "log_sigma": log_sigma,
               "sigma0": T * (0.5 * log_var0).exp()}
        return Draw(state_latent_token(x, x0, self.token_dtype), aux, logp)

    def score(self, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        head, T = self.head, self.temperature
        path = draw.aux["path"]  # (*batch, K, d)
        batch, (K, d) = path.shape[:-2], path.shape[-2:]
        check(K == head.schedule.steps, "draw", f"a denoising path of this head's {head.schedule.steps} steps", K)
        n = batch.numel()
        states = path.reshape(n * K, d)
        k = torch.arange(K - 1, -1, -1).repeat(n)  # path[i] sits at respaced index K - 1 - i
        z, z_u, s = self._flat(K)
        x0, mean, log_var = head.guided_step(states, k, z, z_u, s, self.meter)
        path, x0, mean = path.reshape(n, K, d), x0.view(n, K, d), mean.view(n, K, d)
        std = T * (0.5 * log_var.view(n, K, d)).exp()
        start = path[:, 0]
        logp = normal_log_prob(start, torch.zeros_like(start), torch.ones_like(start)).sum(-1)
        logp = logp + normal_log_prob(path[:, 1:], mean[:, :-1], std[:, :-1]).sum((-1, -2))
        state = draw.token[..., 0, :].reshape(n, d)
        emitted = state_latent_token(state.double(), x0[:, -1], self.token_dtype)  # the target's last step
        return logp.view(batch), emitted.view(*batch, 2, d)

    def log_prob(self, draw: Draw) -> torch.Tensor:
        return self.score(draw)[0]

    def aligned(self, draw: Draw) -> dict[str, torch.Tensor]:
        """CSpD's aligned chain: this distribution's own chain run with the draw's noise (K
        sequential head calls) -> ``state`` x_0, ``mu0`` (its emitted latent), ``sigma0`` (T sigma_0)
        and ``log_sigma`` (sum of untempered log sigma_k, k >= 1), each (*batch, d)."""
        head, T = self.head, self.temperature
        noise = draw.aux["noise"]
        batch, (K, d) = noise.shape[:-2], noise.shape[-2:]
        n = batch.numel()
        noise = noise.reshape(n, K, d)
        z, z_u, s = self._flat()
        x, log_sigma = noise[:, 0], torch.zeros(n, d, dtype=torch.float64, device=noise.device)
        for i, k in enumerate(range(K - 1, 0, -1)):
            _, mean, log_var = head.guided_step(x, torch.full((n,), k), z, z_u, s, self.meter)
            x = mean + T * (0.5 * log_var).exp() * noise[:, i + 1]
            log_sigma = log_sigma + 0.5 * log_var
        x0, _, log_var0 = head.guided_step(x, torch.zeros(n, dtype=torch.long), z, z_u, s, self.meter)
        out = {"state": x, "mu0": x0, "sigma0": T * (0.5 * log_var0).exp(), "log_sigma": log_sigma}
        return {key: v.view(*batch, d) for key, v in out.items()}
