// Evaluation metrics of fine-tuning tasks, as the reference implementations define them:
// Pearson's r and Spearman's rho as scipy.stats computes them (Spearman: Pearson's r of the
// ranks, tied values sharing their average rank).
#pragma once

#include <vector>

namespace bertrain::train {

// NaN when either side is constant (as scipy, which warns and returns nan).
double pearson(const std::vector<double>& x, const std::vector<double>& y);
double spearman(const std::vector<double>& x, const std::vector<double>& y);
// Ranks 1..n, ties given their average rank (scipy.stats.rankdata's "average").
std::vector<double> average_ranks(const std::vector<double>& x);

}  // namespace bertrain::train
