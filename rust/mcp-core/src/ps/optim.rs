//! The optimizer a server applies, chosen at start-up, and its per-tensor state.

use super::adam::{self, AdamConfig, AdamState};
use super::sgd::{self, SgdConfig};
use crate::error::{Error, Result};

/// Which update rule the servers apply to the averaged gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// SGD with optional momentum, weight decay and Nesterov.
    Sgd(SgdConfig),
    /// Adam or AdamW.
    Adam(AdamConfig),
}

impl Default for Optimizer {
    fn default() -> Self {
        Optimizer::Sgd(SgdConfig::default())
    }
}

impl Optimizer {
    /// Parses `"sgd"`, `"adam"` or `"adamw"` with the given hyper-parameters
    /// (momentum and nesterov are SGD's; betas and eps Adam's).
    #[allow(clippy::too_many_arguments)]
    pub fn from_name(
        name: &str,
        lr: f64,
        momentum: f64,
        weight_decay: f64,
        nesterov: bool,
        betas: (f64, f64),
        eps: f64,
    ) -> Result<Optimizer> {
        if !(lr.is_finite() && lr > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "lr must be a positive number, got {lr}"
            )));
        }
        if !(0.0..1.0).contains(&momentum)
            || !(0.0..1.0).contains(&betas.0)
            || !(0.0..1.0).contains(&betas.1)
        {
            return Err(Error::InvalidArgument(format!(
                "momentum and betas must be in [0, 1), got momentum={momentum}, betas={betas:?}"
            )));
        }
        if !(weight_decay.is_finite() && weight_decay >= 0.0 && eps.is_finite() && eps >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "weight_decay and eps must be >= 0, got {weight_decay} and {eps}"
            )));
        }
        if nesterov && momentum == 0.0 {
            return Err(Error::InvalidArgument(
                "nesterov needs a momentum above 0".into(),
            ));
        }
        match name.to_ascii_lowercase().as_str() {
            "sgd" => Ok(Optimizer::Sgd(SgdConfig {
                lr: lr as f32,
                momentum: momentum as f32,
                weight_decay: weight_decay as f32,
                nesterov,
            })),
            n @ ("adam" | "adamw") => Ok(Optimizer::Adam(AdamConfig {
                lr,
                beta1: betas.0,
                beta2: betas.1,
                eps,
                weight_decay,
                decoupled: n == "adamw",
            })),
            other => Err(Error::InvalidArgument(format!(
                "unknown optimizer {other:?}; use 'sgd', 'adam' or 'adamw'"
            ))),
        }
    }

    /// A fresh state for a tensor of `n` elements.
    pub fn new_state(&self, n: usize) -> OptState {
        match self {
            Optimizer::Sgd(c) if c.momentum == 0.0 => OptState::Sgd {
                momentum: Vec::new(),
            },
            Optimizer::Sgd(_) => OptState::Sgd {
                momentum: vec![0.0; n],
            },
            Optimizer::Adam(_) => OptState::Adam {
                m: vec![0.0; n],
                v: vec![0.0; n],
                state: AdamState::default(),
            },
        }
    }

    /// Applies one step to `params` with `grad`. Fails if `state` belongs to the other
    /// optimizer or has the wrong length (a restore from a checkpoint of another setup).
    pub fn apply(&self, state: &mut OptState, params: &mut [f32], grad: &[f32]) -> Result<()> {
        if grad.len() != params.len() {
            return Err(Error::InvalidArgument(format!(
                "gradient of {} elements for a tensor of {}",
                grad.len(),
                params.len()
            )));
        }
        match (self, state) {
            (Optimizer::Sgd(c), OptState::Sgd { momentum }) => {
                if c.momentum != 0.0 && momentum.len() != params.len() {
                    return Err(Error::InvalidArgument(
                        "momentum buffer of the wrong length".into(),
                    ));
                }
                sgd::step(c, params, grad, momentum);
                Ok(())
            }
            (Optimizer::Adam(c), OptState::Adam { m, v, state }) => {
                if m.len() != params.len() || v.len() != params.len() {
                    return Err(Error::InvalidArgument(
                        "Adam moments of the wrong length".into(),
                    ));
                }
                adam::step(c, state, params, grad, m, v);
                Ok(())
            }
            _ => Err(Error::InvalidArgument(
                "optimizer state does not match the optimizer".into(),
            )),
        }
    }
}

/// The optimizer state of one tensor piece.
#[derive(Debug, Clone, PartialEq)]
pub enum OptState {
    /// SGD: the momentum buffer (empty without momentum).
    Sgd {
        /// Momentum buffer.
        momentum: Vec<f32>,
    },
    /// Adam: first and second moments and the step counter.
    Adam {
        /// First moment.
        m: Vec<f32>,
        /// Second moment.
        v: Vec<f32>,
        /// Step counter and beta powers.
        state: AdamState,
    },
}

impl OptState {
    /// The state's buffers by name, for checkpoints.
    pub fn buffers(&self) -> Vec<(&'static str, &[f32])> {
        match self {
            OptState::Sgd { momentum } => vec![("momentum", momentum)],
            OptState::Adam { m, v, .. } => vec![("m", m), ("v", v)],
        }
    }

    /// The step counter and beta powers (Adam), for checkpoints.
    pub fn counters(&self) -> (u64, f64, f64) {
        match self {
            OptState::Sgd { .. } => (0, 1.0, 1.0),
            OptState::Adam { state, .. } => (state.t, state.b1_pow, state.b2_pow),
        }
    }
}

/// Deterministic values in [-1, 1] for the kernels' tests (SGD and Adam).
#[cfg(test)]
pub(crate) fn test_data(n: usize, salt: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(salt) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}
