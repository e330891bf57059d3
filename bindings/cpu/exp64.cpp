#include "exp64.hpp"

namespace glm::cpu {

double exp64(double x) { return num::exp64(x); }

}  // namespace glm::cpu
