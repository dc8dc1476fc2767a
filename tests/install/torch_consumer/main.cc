// Saves a module through an installed ckptio::torch and loads it back into
// another: what a LibTorch trainer linking the installed package does.
#include <ckptio/torch.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  torch::manual_seed(1);
  torch::nn::Linear saved(4, 3), loaded(4, 3);
  auto ckpt = ckptio::Checkpointer::Open(argv[1], ckptio::RankInfo{});
  if (!ckpt.ok()) return std::cerr << ckpt.status() << "\n", 1;
  ckptio::State out{{"model", saved}};
  ckptio::Status s = (*ckpt)->Save(3, out);
  if (!s.ok()) return std::cerr << s << "\n", 1;
  ckptio::State in{{"model", loaded}};
  ckptio::LoadOptions cpu;
  cpu.map_location = ckptio::MapLocation::To("cpu");
  auto got = (*ckpt)->Load(in, cpu);
  if (!got.ok()) return std::cerr << got.status() << "\n", 1;
  if (got->step != 3 || !torch::equal(saved->weight, loaded->weight))
    return std::cerr << "round trip failed\n", 1;
  std::cout << "torch consumer: step " << *got->step << " round-tripped, next " << got->next_step()
            << "\n";
  return 0;
}
