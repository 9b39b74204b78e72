// Generated from kernels/modes.py (edit the table there): python -m compactionrl_fast.kernels --write-header
// The ops' mode codes for the C++/CUDA kernels; tests/test_modes.py checks this file is current.
#pragma once
#include <cstdint>

namespace crf {

// cross_segment
enum CrossMode : int64_t { kCrossNone = 0, kCrossPaper = 1, kCrossStitched = 2 };

// lambda
enum LamMode : int64_t { kLamConst = 0, kLamAdaptiveSegment = 1, kLamAdaptiveRollout = 2, kLamTensor = 3 };

// reduction
enum Reduction : int64_t {
  kReductionTokenMean = 0,
  kReductionSegmentMean = 1,
  kReductionRolloutMean = 2,
  kReductionSum = 3,
};

// reward_placement
enum RewardPlacement : int64_t { kRewardPaper = 0, kRewardStitched = 1 };

}  // namespace crf

// Every mode of a group, e.g. for a loop: for (int64_t c : CRF_CROSS_MODES).
#define CRF_CROSS_MODES {crf::kCrossNone, crf::kCrossPaper, crf::kCrossStitched}
#define CRF_LAM_MODES {crf::kLamConst, crf::kLamAdaptiveSegment, crf::kLamAdaptiveRollout, crf::kLamTensor}
#define CRF_REDUCTION_MODES \
  {crf::kReductionTokenMean, crf::kReductionSegmentMean, crf::kReductionRolloutMean, crf::kReductionSum}
#define CRF_REWARD_MODES {crf::kRewardPaper, crf::kRewardStitched}

// Whether segment_gae's per-segment numbers read the segments' trainable-token counts.
#define CRF_NEEDS_COUNTS(lam_mode, cross) \
  ((cross) == crf::kCrossPaper || (lam_mode) == crf::kLamAdaptiveSegment || (lam_mode) == crf::kLamAdaptiveRollout)

// Every mode as X(group, name, constant), e.g. to expose them to Python (csrc/module.cpp).
#define CRF_MODES(X) \
  X("cross_segment", "none", crf::kCrossNone) \
  X("cross_segment", "paper", crf::kCrossPaper) \
  X("cross_segment", "stitched", crf::kCrossStitched) \
  X("lambda", "const", crf::kLamConst) \
  X("lambda", "adaptive-segment", crf::kLamAdaptiveSegment) \
  X("lambda", "adaptive-rollout", crf::kLamAdaptiveRollout) \
  X("lambda", "tensor", crf::kLamTensor) \
  X("reduction", "token-mean", crf::kReductionTokenMean) \
  X("reduction", "segment-mean", crf::kReductionSegmentMean) \
  X("reduction", "rollout-mean", crf::kReductionRolloutMean) \
  X("reduction", "sum", crf::kReductionSum) \
  X("reward_placement", "paper", crf::kRewardPaper) \
  X("reward_placement", "stitched", crf::kRewardStitched)
