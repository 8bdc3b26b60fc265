//! The baseline: AdamW on the exact mean of every replica's gradient (what all-reduce gives).

use tch::Tensor;

pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: i32,
}

impl AdamW {
    pub fn new(params: &[Tensor], weight_decay: f64) -> AdamW {
        AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay,
            m: params.iter().map(|p| p.detach().zeros_like()).collect(),
            v: params.iter().map(|p| p.detach().zeros_like()).collect(),
            t: 0,
        }
    }

    /// One step with gradients `grads` (already averaged and clipped) at rate `lr`.
    pub fn step(&mut self, params: &[Tensor], grads: &[Tensor], lr: f64) {
        self.t += 1;
        let bc1 = 1.0 - self.beta1.powi(self.t);
        let bc2 = 1.0 - self.beta2.powi(self.t);
        tch::no_grad(|| {
            for ((p, g), (m, v)) in params
                .iter()
                .zip(grads)
                .zip(self.m.iter_mut().zip(self.v.iter_mut()))
            {
                let mut p = p.shallow_clone();
                let _ = m.g_mul_scalar_(self.beta1);
                let _ = m.g_add_(&(g * (1.0 - self.beta1)));
                let _ = v.g_mul_scalar_(self.beta2);
                let _ = v.g_add_(&(g * g * (1.0 - self.beta2)));
                let _ = p.g_mul_scalar_(1.0 - lr * self.weight_decay);
                let upd = (&*m / bc1) / ((&*v / bc2).sqrt() + self.eps);
                let _ = p.g_sub_(&(upd * lr));
            }
        });
    }
}
