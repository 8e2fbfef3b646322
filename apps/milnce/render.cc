// gen-video's pictures: moving coloured shapes, one concept per segment (data_util.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "milnce/data_util.h"
#include "milnce/video.h"

namespace milnce::detail {

namespace {

struct Colour {
  const char* name;
  uint8_t r, g, b;
};
constexpr Colour kColours[] = {{"red", 230, 40, 40},      {"green", 40, 200, 60},  {"blue", 50, 80, 240},
                               {"yellow", 240, 230, 50},  {"magenta", 220, 50, 220}, {"cyan", 50, 220, 230},
                               {"white", 245, 245, 245},  {"orange", 245, 140, 30}};
constexpr const char* kShapes[] = {"circle", "square", "triangle", "cross"};
constexpr int kNumColours = static_cast<int>(std::size(kColours));
constexpr int kNumShapes = static_cast<int>(std::size(kShapes));

// Whether (dx, dy) from the centre of a shape of half-size r is inside it.
bool inside(int shape, double dx, double dy, double r) {
  switch (shape) {
    case 0: return dx * dx + dy * dy <= r * r;
    case 1: return std::abs(dx) <= r * 0.85 && std::abs(dy) <= r * 0.85;
    case 2: return dy <= r * 0.8 && dy >= -r && std::abs(dx) <= (dy + r) * 0.6;  // apex up
    default: return (std::abs(dx) <= r * 0.3 && std::abs(dy) <= r) || (std::abs(dy) <= r * 0.3 && std::abs(dx) <= r);
  }
}

// Concept c's colour and shape (indexes): block b of 8 concepts pairs colour i with shape (i + b) % 4,
// distinct pairs for 32 concepts.
std::pair<int, int> look(int c) {
  c %= kMaxVideoConcepts;
  return {c % kNumColours, (c % kNumColours + c / kNumColours) % kNumShapes};
}

}  // namespace

std::pair<std::string, std::string> videoConcept(int c) {
  const auto [colour, shape] = look(c);
  return {kColours[colour].name, kShapes[shape]};
}

void renderVideo(const std::string& path, const std::vector<double>& bounds, const std::vector<int>& concepts,
                 int size, int fps, std::mt19937_64& rng) {
  VideoWriter writer(path, size, size, fps);
  const auto frames = static_cast<int64_t>(std::ceil(bounds.back() * fps));
  std::vector<uint8_t> rgb(static_cast<size_t>(size) * size * 3);
  // The background: dark, tinted per video, with a fixed texture (noise that changes every frame would
  // cost the encoder and decoder more than the shapes do).
  const int tint = static_cast<int>(uniformInt(rng, 10, 40));
  std::vector<uint8_t> background(rgb.size());
  for (size_t i = 0; i < background.size(); i += 3) {
    const auto noise = static_cast<int>(uniformInt(rng, 0, 12));
    background[i] = background[i + 1] = static_cast<uint8_t>(20 + noise);
    background[i + 2] = static_cast<uint8_t>(tint + noise);
  }
  // The shape's centre stays kEdge + r from the frame's sides: a crop of size - 8 anywhere keeps it whole.
  constexpr double kEdge = 9;
  size_t seg = 0;
  double x = 0, y = 0, vx = 0, vy = 0, r = 0, lo = 0, hi = 0;
  int64_t seg_start = -1;
  for (int64_t f = 0; f < frames; ++f) {
    const double t = static_cast<double>(f) / fps;
    while (seg + 1 < concepts.size() && t >= bounds[seg + 1]) ++seg;
    if (static_cast<int64_t>(seg) != seg_start) {  // a new segment: a new size, place and motion
      seg_start = static_cast<int64_t>(seg);
      r = size * (0.12 + 0.06 * uniform01(rng));
      lo = kEdge + r, hi = size - kEdge - r;
      x = lo + (hi - lo) * uniform01(rng);
      y = lo + (hi - lo) * uniform01(rng);
      const double speed = size * (0.01 + 0.02 * uniform01(rng)), angle = 6.283185307179586 * uniform01(rng);
      vx = speed * std::cos(angle);
      vy = speed * std::sin(angle);
    }
    x += vx, y += vy;
    if (x < lo || x > hi) vx = -vx, x = std::clamp(x, lo, hi);
    if (y < lo || y > hi) vy = -vy, y = std::clamp(y, lo, hi);
    const auto [colour, shape] = look(concepts[seg]);
    const Colour& col = kColours[colour];
    for (int py = 0; py < size; ++py)
      for (int px = 0; px < size; ++px) {
        uint8_t* p = &rgb[(static_cast<size_t>(py) * size + px) * 3];
        if (inside(shape, px + 0.5 - x, py + 0.5 - y, r)) {
          p[0] = col.r, p[1] = col.g, p[2] = col.b;
        } else {
          std::copy_n(&background[(static_cast<size_t>(py) * size + px) * 3], 3, p);
        }
      }
    writer.write(rgb.data());
  }
  writer.finish();
}

}  // namespace milnce::detail
