"""reprs of the quantized tensor classes, pinned with expecttest (EXPECTTEST_ACCEPT=1 rewrites
them after a deliberate change). A repr shows the outer shape and dtype, every piece of decode
metadata and the backends, never the bytes."""

from __future__ import annotations

import expecttest
import torch

from qtensor import HybridTensor, MXFP8Spec, MXFP8Tensor, NVFP4Spec, NVFP4Tensor


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


class TestRepr(expecttest.TestCase):
    def test_nvfp4_default(self):
        self.assertExpectedInline(repr(NVFP4Tensor.from_hp(_x(32, 64))), """NVFP4Tensor(shape=(32, 64), dtype=torch.bfloat16, axis=rowwise, spec=NVFP4Spec(), act_spec=None, quant_backend=cpu, gemm_backend=emulated, device=cpu)""")

    def test_nvfp4_options_and_act_spec(self):
        t = NVFP4Tensor.from_hp(_x(32, 64), block_2d=True, fourover6="mse", e4m3_bound=256)
        t = t.replace(act_spec=NVFP4Spec(row_scaled=True, fourover6="mae"))
        self.assertExpectedInline(repr(t), """NVFP4Tensor(shape=(32, 64), dtype=torch.bfloat16, axis=rowwise, spec=NVFP4Spec(block_2d=True, fourover6=mse, e4m3_bound=256), act_spec=NVFP4Spec(row_scaled=True, fourover6=mae), quant_backend=cpu, gemm_backend=emulated, device=cpu)""")

    def test_nvfp4_transposed_columnwise(self):
        t = NVFP4Tensor.from_hp(_x(32, 64), columnwise=True, rht=True).t()
        self.assertExpectedInline(repr(t), """NVFP4Tensor(shape=(64, 32), dtype=torch.bfloat16, axis=rowwise, spec=NVFP4Spec(rht=True, columnwise=True), act_spec=None, quant_backend=cpu, gemm_backend=emulated, device=cpu)""")

    def test_mxfp8(self):
        t = MXFP8Tensor.from_hp(_x(2, 32, 64), scale_rule="floor").to(torch.float32)
        self.assertExpectedInline(repr(t), """MXFP8Tensor(shape=(2, 32, 64), dtype=torch.float32, axis=rowwise, spec=MXFP8Spec(scale_rule=floor), act_spec=None, quant_backend=cpu, gemm_backend=emulated, device=cpu)""")

    def test_hybrid(self):
        t = HybridTensor.from_hp(_x(32, 64), rowwise=NVFP4Spec(), columnwise=MXFP8Spec(),
                                 columnwise_source="rowwise_dequantized")
        self.assertExpectedInline(repr(t), """\
HybridTensor(shape=(32, 64), dtype=torch.bfloat16, columnwise_source=rowwise_dequantized,
  rowwise=NVFP4Tensor(shape=(32, 64), dtype=torch.bfloat16, axis=rowwise, spec=NVFP4Spec(), act_spec=None, quant_backend=cpu, gemm_backend=emulated, device=cpu),
  columnwise=MXFP8Tensor(shape=(32, 64), dtype=torch.bfloat16, axis=columnwise, spec=MXFP8Spec(columnwise=True), act_spec=None, quant_backend=cpu, gemm_backend=emulated, device=cpu))""")

    def test_quantized_linear_module(self):
        from qtensor import NVFP4DynamicActivationNVFP4WeightConfig, quantize_

        m = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16))
        quantize_(m, NVFP4DynamicActivationNVFP4WeightConfig(activation=NVFP4Spec(row_scaled=True)))
        self.assertExpectedInline(repr(m), """\
Sequential(
  (0): Linear(in_features=64, out_features=32, weight=NVFP4Tensor(shape=(32, 64), dtype=torch.bfloat16, axis=rowwise, spec=NVFP4Spec(), act_spec=NVFP4Spec(row_scaled=True), quant_backend=cpu, gemm_backend=emulated, device=cpu))
)""")


if __name__ == "__main__":
    expecttest.run_tests()
