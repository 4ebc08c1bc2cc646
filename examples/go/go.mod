module vsan.example/vsan

go 1.18
