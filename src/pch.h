// Precompiled header: the heavy, stable headers every translation unit uses.
#pragma once
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
