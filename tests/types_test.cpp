// Views, byte ranges and the ISA enum.
#include "moecert/types.hpp"

#include <vector>

#include "test_util.hpp"

using namespace moecert;

TEST_CASE("core.types: overlaps is exact on byte ranges", "[core][types][alias]") {
  for (std::uintptr_t a0 = 0; a0 < 12; ++a0)
    for (std::uintptr_t a1 = 0; a1 < 12; ++a1)
      for (std::uintptr_t b0 = 0; b0 < 12; ++b0)
        for (std::uintptr_t b1 = 0; b1 < 12; ++b1) {
          bool brute = false;
          for (std::uintptr_t x = 0; x < 12; ++x)
            brute |= (a0 <= x && x < a1) && (b0 <= x && x < b1);
          REQUIRE(overlaps({a0, a1}, {b0, b1}) == brute);
        }
}

TEST_CASE("core.types: MatView byte range covers strided rows exactly", "[core][types][alias]") {
  std::vector<float> buf(100);
  MatView<float> m(buf.data(), 3, 5, 10);  // rows at 0, 10, 20; last element at 24
  CHECK(m.bytes().size() == 25 * sizeof(float));
  CHECK(overlaps(m.bytes(), View<float>{buf.data() + 24, 1}.bytes()));
  CHECK_FALSE(overlaps(m.bytes(), View<float>{buf.data() + 25, 75}.bytes()));
  CHECK(&m(2, 4) == buf.data() + 24);
  MatView<const float> c = m;
  CHECK(c.bytes().begin == m.bytes().begin);
}

TEST_CASE("core.types: empty views overlap nothing", "[core][types][alias]") {
  std::vector<float> buf(10);
  View<float> empty{buf.data() + 3, 0};
  MatView<float> no_rows(buf.data(), 0, 5);
  CHECK(empty.bytes().empty());
  CHECK(no_rows.bytes().empty());
  CHECK_FALSE(overlaps(empty.bytes(), View<float>{buf.data(), 10}.bytes()));
  CHECK_FALSE(overlaps(no_rows.bytes(), View<float>{buf.data(), 10}.bytes()));
}

TEST_CASE("core.types: isa names are distinct and stable", "[core][types]") {
  CHECK(isa_name(Isa::scalar) == "scalar");
  CHECK(isa_name(Isa::avx512_bf16) == "avx512_bf16");
  CHECK(isa_name(Isa::avx2) == "avx2");
  CHECK(static_cast<int>(Isa::avx2) == 4);  // the C ABI's value
  CHECK(isa_name(Isa::amx_bf16) == "amx_bf16");
  CHECK(isa_name(Isa::amx_emu) == "amx_emu");
}
