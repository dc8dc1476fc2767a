// Saves and loads one checkpoint through an installed ckptio.
#include <ckptio/ckptio.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  auto store = ckptio::OpenStore(argv[1]);
  if (!store.ok()) return std::cerr << store.status() << "\n", 1;
  auto writer = (*store)->OpenWriter({});
  if (!writer.ok()) return std::cerr << writer.status() << "\n", 1;
  auto pending = (*writer)->Begin(7);
  if (!pending.ok()) return std::cerr << pending.status() << "\n", 1;
  const std::string bytes = "hello from a consumer";
  ckptio::Status s = (*pending)->PutObject("greeting.bin", bytes.data(), bytes.size());
  if (!s.ok()) return std::cerr << s << "\n", 1;
  auto info = (*pending)->Commit();
  if (!info.ok()) return std::cerr << info.status() << "\n", 1;
  auto reader = (*store)->OpenLatest();
  if (!reader.ok()) return std::cerr << reader.status() << "\n", 1;
  auto back = (*reader)->ReadAll("greeting.bin");
  if (!back.ok() || *back != bytes) return std::cerr << "round trip failed\n", 1;
  std::cout << "consumer: step " << (*reader)->step() << " round-tripped\n";
  return 0;
}
