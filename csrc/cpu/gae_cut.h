// Long chains of the CPU segment_gae scan (csrc/cpu/gae.cpp), cut into pieces scanned in two passes, and the
// threads' share of the chains. Included by gae.cpp only.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../common/count.h"
#include "../common/gae_step.h"
#include "gae_lanes.h"

namespace crf {
namespace gae_cpu {

// Runs `list` on the threads: ranges of chains of about equal token counts, one per task (~32K tokens at least:
// waking a pool thread costs more than scanning a small batch).
template <typename idx_t>
void run_parallel(const ChainScan<idx_t>& scan, const std::vector<Chain>& list) {
  std::vector<int64_t> acc(1, 0);  // prefix sums of the chains' lengths
  for (const Chain& c : list) acc.push_back(acc.back() + c.tokens);
  const int64_t n = (int64_t)list.size(), total = acc.back();
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / 32768));
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      auto at_share = [&](int64_t j) {
        return (int64_t)(std::lower_bound(acc.begin(), acc.end(), total * j / tasks) - acc.begin());
      };
      const int64_t c0 = std::min(at_share(k), n), c1 = k + 1 == tasks ? n : std::min(at_share(k + 1), n);
      if (c1 > c0) scan.run(list.data() + c0, c1 - c0);
    }
  });
}

// Long chains, cut into pieces. A chain of more than max(32K, T/8) tokens would leave the lanes idle while one
// lane walks it one dependent step at a time, so it is cut into pieces of about max(16K, T/16) tokens. Pass 1
// (`first`) runs every piece but a chain's earliest from a zero carry and keeps the state at its first token
// (writing only the chain's last piece, whose zero carry is its true one; the others skip their outputs'
// conversions, transposes and stores); with the products of gamma*lam over each piece's trainable tokens these
// states give every piece's carry (`carry_pieces`, float64). Pass 2 (`second`) runs the chains left whole and
// every piece but a chain's last. The cut depends only on the layout, so the result does not depend on the
// thread count or the vector width.
struct Cut {
  std::vector<Chain> first, second;
  // per cut chain and piece k (earliest first): its index in `first` (-1 for k = 0) and in `second` (-1 for the last)
  std::vector<std::vector<int64_t>> pieces, in_second;
};

template <typename idx_t>
Cut cut_long_chains(const ChainScan<idx_t>& scan, const std::vector<Chain>& chains, int64_t T) {
  Cut cut;
  const int64_t piece = std::max<int64_t>(16384, T / 16);
  for (const Chain& c : chains) {
    if (c.tokens <= 2 * piece) {
      cut.second.push_back(c);
      continue;
    }
    const int64_t m = (c.tokens + piece - 1) / piece;
    // chain offset o (tokens of segments lo.. in order) -> its segment and position, for increasing o; cuts
    // fall on tokens, so every piece's first and last segment hold some of its tokens
    int64_t s = c.lo, before = 0;  // tokens of the chain before segment s
    auto locate = [&](int64_t o) {
      while (before + scan.len(s) <= o) before += scan.len(s++);
      return std::pair<int64_t, int64_t>{s, scan.first(s) + (o - before)};
    };
    std::vector<int64_t> ids(m, -1), in_second(m, -1);
    for (int64_t k = 0; k < m; ++k) {
      const int64_t o0 = c.tokens * k / m, o1 = c.tokens * (k + 1) / m;
      const auto [s0, b0] = locate(o0);
      Chain p{s0, c.hi, o1 - o0};
      p.begin = b0;
      if (k + 1 < m) {  // ends after its last token
        const auto [s1, b1] = locate(o1 - 1);
        p.hi = s1, p.end = b1 + 1;
      }
      if (k > 0) {
        p.id = (int64_t)cut.first.size(), ids[k] = p.id;
        p.write = k + 1 == m;  // the others are scanned again in pass 2: their state is all pass 1 needs
        cut.first.push_back(p);
        p.id = -1, p.write = true;
      }
      if (k + 1 < m) in_second[k] = (int64_t)cut.second.size(), cut.second.push_back(p);
    }
    cut.pieces.push_back(ids);
    cut.in_second.push_back(in_second);
  }
  return cut;
}

// Each piece's carry, from the chain's end backwards: the state entering piece k (from the later side) through
// piece k's map gives the state entering piece k-1. The map: the products of gamma*lam (critic: gamma*lam_critic)
// over the piece's trainable tokens (xa; ya: gamma times all but the latest one's, where the carried value enters;
// crf::power_count per segment, float64), and pass 1's state from a zero carry.
template <typename idx_t>
void carry_pieces(const ChainScan<idx_t>& scan, Cut& cut, const std::vector<crf::GaeState>& finals) {
  for (size_t j = 0; j < cut.pieces.size(); ++j) {
    const std::vector<int64_t>& ids = cut.pieces[j];
    crf::GaeState carry{0.0, 0.0, 0.0};
    for (size_t k = ids.size() - 1; k >= 1; --k) {
      const Chain& p = cut.first[ids[k]];
      int64_t latest = -1;
      std::vector<int64_t> n(p.hi - p.lo + 1);
      for (int64_t s = p.lo; s <= p.hi; ++s) {
        const auto [b, e] = scan.span(s, p.lo, p.hi, p.begin, p.end);
        if ((n[s - p.lo] = crf::count_true(scan.mask, b, e))) latest = s;
      }
      double xa = 1.0, ya = scan.gamma, xc = 1.0, yc = scan.gamma;
      for (int64_t s = p.lo; s <= p.hi; ++s) {
        const double gl = scan.P[s].gl, glc = scan.own_critic ? scan.P[s].glc : gl;
        const int64_t ns = n[s - p.lo], ny = ns - (s == latest);
        xa *= crf::power_count(gl, ns), ya *= crf::power_count(gl, ny);
        xc *= crf::power_count(glc, ns), yc *= crf::power_count(glc, ny);
      }
      const crf::GaeState& f = finals[ids[k]];
      const bool any = latest >= 0;
      carry = crf::GaeState{xa * carry.a + (any ? ya * carry.v : 0.0) + f.a, any ? f.v : carry.v,
                            xc * carry.ac + (any ? yc * carry.v : 0.0) + f.ac};
      Chain& q = cut.second[cut.in_second[j][k - 1]];
      q.a0 = carry.a, q.ac0 = carry.ac, q.v0 = carry.v;
    }
  }
}

}  // namespace gae_cpu
}  // namespace crf
